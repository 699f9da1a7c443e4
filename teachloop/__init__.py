__version__ = "0.1.0"

# Every optimizer takes its multi-tensor step whichever module it was imported from: `teachloop.fast` adds its planner
# to the optimizer's list when imported, and importing a submodule runs this file first. (nbdev writes only the
# version line here; the import of a higher module from the package root creates no cycle between the modules.)
import teachloop.fast  # noqa: E402,F401

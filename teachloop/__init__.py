__version__ = "0.1.0"

# What a module adds to the modules below it is there whichever module a user imports first: importing any submodule
# runs this file, which imports every module that extends a lower one, so the library behaves the same in any import
# order (tests/test_structure.py checks it). They add: the multi-tensor steps to the optimizer (`optim.fast`), the
# default callbacks to every learner (`callback.core`), the Learner's methods of the later notebooks (`fit_one_cycle`,
# `lr_find`, `fine_tune`, `save_checkpoint`, `export`, `distributed`, ...) and each optimizer part's declared facts (every optimizer
# module). (nbdev writes only the version line here; an import from the package root makes no cycle between the
# modules.)
import teachloop.optim.fast  # noqa: E402,F401
import teachloop.optim.more  # noqa: E402,F401
import teachloop.optim.recent  # noqa: E402,F401
import teachloop.optim.interop  # noqa: E402,F401
import teachloop.callback.core  # noqa: E402,F401
import teachloop.callback.schedule  # noqa: E402,F401
import teachloop.fine_tune  # noqa: E402,F401
import teachloop.callback.checkpoint  # noqa: E402,F401
import teachloop.inference  # noqa: E402,F401
import teachloop.callback.distributed  # noqa: E402,F401

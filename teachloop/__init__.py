__version__ = "0.1.0"

# What a module adds to the modules below it is there whichever module a user imports first.
# - The optimizer modules add to the generic optimizer (`optim.fast` the multi-tensor steps, every optimizer module its
#   optimizers' declared facts). Importing any submodule runs this file, which imports them.
# - The modules of later notebooks that add to the Learner (its default callbacks, and `fit_one_cycle`, `lr_find`,
#   `fine_tune`, `save_checkpoint`, `export`, `distributed`, ...) are named here; teachloop.learner imports them as its
#   import ends (or, when that import is part of one of theirs, when the first learner is made): importing the
#   optimizers loads no callback.
# tests/test_structure.py checks both. (nbdev writes only the version line here.)
import teachloop.optim.fast  # noqa: E402,F401
import teachloop.optim.more  # noqa: E402,F401
import teachloop.optim.recent  # noqa: E402,F401
import teachloop.optim.interop  # noqa: E402,F401

LEARNER_ADDITIONS = ('teachloop.callback.core', 'teachloop.callback.schedule', 'teachloop.fine_tune',
                     'teachloop.callback.checkpoint', 'teachloop.inference', 'teachloop.callback.distributed')

"""The comments beside parameters (nbdev's docments) reach `help()` and editors: the export writes them into the
docstrings of the generated modules (tools/nbdev_docstrings.py)."""
import inspect
import pydoc
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tools'))
from nbdev_docstrings import add_parameter_docs  # noqa: E402

from teachloop.callback.schedule import fit_one_cycle  # noqa: E402,F401
from teachloop.learner import Learner  # noqa: E402


def test_help_shows_each_parameters_comment():
    text = pydoc.render_doc(Learner.fit, renderer=pydoc.plaintext)
    assert 'n_epoch: number of passes over the training data' in text
    assert 'cbs: callbacks used for this fit only' in text
    assert 'lr_max: peak learning rate' in inspect.getdoc(Learner.fit_one_cycle)


def test_a_constructors_parameters_go_to_its_class():
    doc = inspect.getdoc(Learner)
    assert doc.splitlines()[0] == Learner.__doc__.splitlines()[0] and '\nArgs:\n' in doc and 'dls: ' in doc


SOURCE = '''@patch
def fit(self:Learner,
        n_epoch:int,  # number of epochs, β too
        moms=(0.95,
              0.85),  # momentum (start, end)
        *args,  # more
        cbs=None,  # extra callbacks
       ):  # what it returns is not a parameter
    "Fit, with β and \\\\ a backslash."
    def inner(a,  # not documented: a nested function
              ): "Inner."
    return n_epoch

def one_line(a, b): # a comment after the whole signature documents no parameter
    "One line."

def undocumented(a, b):
    "No comments."
'''


def test_the_comments_are_added_under_args_and_nothing_else_changes():
    out = add_parameter_docs(SOURCE)
    namespace = {'patch': lambda f: f, 'Learner': object}
    exec(compile(out, 'generated', 'exec'), namespace)
    assert inspect.getdoc(namespace['fit']) == ('Fit, with β and \\ a backslash.\n\nArgs:\n    n_epoch: number of epochs, '
                                                'β too\n    moms: momentum (start, end)\n    args: more\n'
                                                '    cbs: extra callbacks')
    assert namespace['one_line'].__doc__ == 'One line.' and namespace['undocumented'].__doc__ == 'No comments.'
    assert out.replace(out[out.index('"""'):out.index('"""', out.index('"""') + 3) + 3], '"X"') == \
        SOURCE.replace('"Fit, with β and \\\\ a backslash."', '"X"')
    assert add_parameter_docs('def f(:\n') == 'def f(:\n'  # what does not parse is left as it is


def test_an_args_section_written_by_hand_beside_the_comments_is_refused():
    # the export would write a second section under it: the notebook keeps the comments only
    with pytest.raises(ValueError, match=r"'Twice\.' \(line 3\) has an `Args:` section.*remove the section"):
        add_parameter_docs('def f(a,  # the a\n      ):\n    """Twice.\n\n    Args:\n        a: the a\n    """\n')

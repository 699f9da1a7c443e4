"""`learn.export` and `load_learner`: predictions in a fresh process equal the learner's, any batch size, clear refusals
(a model torch.export cannot trace, wrong inputs, files that are not exports), and files that would run code refused."""
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import warnings
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from teachloop.data import DataLoaders, digits_cnn, digits_dls
from teachloop.inference import (InferenceLearner, check_archive, class_path, export_model, is_weights_file, load_learner,
                                 model_class, program_inputs, read_weights_export)
from teachloop.learner import Learner
from teachloop.testing import digits_learner, quiet

# A fresh process that loads an export and saves what it predicts; it imports teachloop and torch, nothing of the test.
FRESH = """
import sys, torch
from teachloop.data import digits_dls
from teachloop.inference import load_learner
learn = load_learner(sys.argv[1])
valid = digits_dls().valid
inputs, probs, targets, decoded = learn.get_preds(valid, with_input=True, with_decoded=True)
unlabelled = learn.get_preds([x for x, _ in valid])
modules = sorted(m for m in sys.modules if m.startswith('teachloop'))
torch.save({'inputs': inputs, 'probs': probs, 'targets': targets, 'decoded': decoded, 'unlabelled': unlabelled,
            'item': learn.predict(valid.dataset[5]), 'modules': modules}, sys.argv[2])
"""


def predicted_in_a_fresh_process(path, tmp_path):
    out = tmp_path / 'fresh.pt'
    # The same number of threads as this process: the program then runs the learner's kernels in the same order
    env = {**os.environ, 'OMP_NUM_THREADS': str(torch.get_num_threads())}
    done = subprocess.run([sys.executable, '-c', FRESH, str(path), str(out)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope='module')
def trained():
    learn = digits_learner()
    learn.fit(1)
    return learn


def test_a_fresh_process_predicts_exactly_as_the_learner(trained, tmp_path):
    path = trained.export(tmp_path / 'digits.pt2', vocab=[f'digit {i}' for i in range(10)])
    fresh = predicted_in_a_fresh_process(path, tmp_path)
    inputs, probs, targets, decoded = trained.get_preds(with_input=True, with_decoded=True)
    # Exactly: the program calls the same aten operators as the model (conv2d, relu, linear), with the same kernels,
    # threads and CPU capability, so each value is computed in the same order; a tolerance would hide a wrong weight.
    assert torch.equal(fresh['probs'], probs) and torch.equal(fresh['decoded'], decoded)
    assert torch.equal(fresh['targets'], targets) and torch.equal(fresh['inputs'], inputs)
    assert torch.allclose(probs.sum(dim=1), torch.ones(len(probs)))  # probabilities, by default
    unlabelled_probs, no_targets = fresh['unlabelled']
    assert torch.equal(unlabelled_probs, probs) and no_targets is None
    x, y = trained.dls.valid.dataset[5]
    decoded_item, probs_item = trained.predict(x)
    assert fresh['item'][0] == f'digit {int(decoded_item)}' and torch.equal(fresh['item'][1], probs_item)
    assert 'teachloop.testing' not in fresh['modules']


def test_the_fresh_process_needs_no_code_of_the_model(tmp_path):
    "A model whose class lives only in this function: pickle cannot store it, the export needs it not."
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn, self.scale = digits_cnn(), nn.Parameter(torch.tensor(2.))
        def forward(self, x): return self.cnn(x) * self.scale
    learn = digits_learner(model_fn=Scaled)
    learn.fit(1)
    with pytest.raises((AttributeError, pickle.PicklingError)): pickle.dumps(learn.model)
    fresh = predicted_in_a_fresh_process(learn.export(tmp_path / 'scaled.pt2'), tmp_path)
    assert torch.equal(fresh['probs'], learn.get_preds()[0])
    assert isinstance(fresh['item'][0], torch.Tensor)  # no vocab: the class index


@pytest.mark.parametrize('n', [1, 2, 7, 359])
def test_the_program_takes_any_batch_size(trained, tmp_path, n):
    learn = load_learner(trained.export(tmp_path / 'digits.pt2'))
    x = torch.rand(n, 1, 8, 8)
    with torch.no_grad(): expected = trained.model.eval()(x).softmax(dim=1)
    probs, targets = learn.get_preds([(x, torch.zeros(n, dtype=torch.long))])
    assert torch.equal(probs, expected) and targets.shape == (n,)


def test_export_changes_nothing_of_the_learner(tmp_path):
    learn = digits_learner()
    learn.dls = digits_dls()
    learn.dls.valid = None  # the example is then a training batch, drawn from a shuffled loader
    train_generator = learn.dls.train.generator
    learn.model.train()
    weights = {k: v.clone() for k, v in learn.model.state_dict().items()}
    before = torch.get_rng_state(), train_generator.get_state(), weights
    learn.export(tmp_path / 'digits.pt2')
    assert learn.model.training
    assert torch.equal(torch.get_rng_state(), before[0]) and torch.equal(train_generator.get_state(), before[1])
    assert all(torch.equal(v, before[2][k]) for k, v in learn.model.state_dict().items())


def test_export_waits_for_no_fit_in_another_thread(tmp_path):
    "A background fit owns the learner: an export would switch its model to eval mode in the middle of a batch."
    learn = digits_learner()
    other = threading.Thread()
    learn.reserve_for(other)
    with pytest.raises(RuntimeError, match='cannot export while this learner trains in another thread'):
        learn.export(tmp_path / 'digits.pt2')
    assert list(tmp_path.iterdir()) == []
    learn.release(other)
    assert learn.export(tmp_path / 'digits.pt2').exists()


def test_the_file_holds_no_data(trained, tmp_path):
    path = trained.export(tmp_path / 'digits.pt2')
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if '/sample_inputs/' in n)
        (args, kwargs) = torch.load(io.BytesIO(archive.read(name)), weights_only=True)
    assert [tuple(a.shape) for a in args] == [(2, 1, 8, 8)] and all(not a.any() for a in args) and kwargs == {}


def test_a_model_torch_export_cannot_trace_is_refused_with_the_cause_and_the_way_out(tmp_path):
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn = digits_cnn()
        def forward(self, x): return self.cnn(x) if x.sum() > 0 else self.cnn(-x)
    learn = digits_learner(model_fn=Branchy)
    path = tmp_path / 'model.pt2'
    path.write_bytes(b'an earlier file')
    with pytest.raises(RuntimeError, match=r'values in a tensor') as caught:
        learn.export(path)
    message = str(caught.value)
    assert 'x.sum() > 0' in message and 'learn.save' in message and 'torch.cond' in message and 'init_args=' in message
    assert caught.value.__cause__ is not None  # torch's own error, kept
    assert path.read_bytes() == b'an earlier file' and sorted(p.name for p in tmp_path.iterdir()) == ['model.pt2']


def test_a_compiled_model_is_exported_as_the_model_it_wraps(trained, tmp_path):
    learn = digits_learner()
    learn.model.load_state_dict(trained.model.state_dict())
    plain = learn.model
    learn.model = torch.compile(plain)  # never called: no compiler needed, the export reads `_orig_mod`
    assert all(k.startswith('_orig_mod.') for k in learn.model.state_dict())
    inference = load_learner(learn.export(tmp_path / 'compiled.pt2'))
    x = torch.rand(4, 1, 8, 8)
    with torch.no_grad(): expected = plain.eval()(x).softmax(dim=1)
    assert torch.equal(inference.get_preds([x])[0], expected)


def test_wrong_inputs_get_a_message_with_the_exported_shape(trained, tmp_path):
    learn = load_learner(trained.export(tmp_path / 'digits.pt2'))
    # the channels are fixed, the sides free (the CNN pools them away): two pixels or more, as torch's rule for a free size
    with pytest.raises(ValueError, match=r"shape \(n, 1, 2\.\., 2\.\.\) and dtype float32.*got shape \(2, 3, 8, 8\)"):
        learn.get_preds([torch.zeros(2, 3, 8, 8)])
    with pytest.raises(ValueError, match=r"dtype float32.*torch.float64"):
        learn.predict(torch.zeros(1, 8, 8, dtype=torch.float64))


def two_input_learner():
    "A learner whose batches are `(image, offset, target)`: two inputs (`n_inp=2`)."
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.cnn, self.offset = digits_cnn(), nn.Linear(3, 10)
        def forward(self, image, offset): return self.cnn(image) + self.offset(offset)
    torch.manual_seed(0)
    x, y = torch.rand(96, 1, 8, 8), torch.randint(0, 10, (96,))
    offsets = torch.randn(96, 3)
    dl = DataLoader(TensorDataset(x, offsets, y), batch_size=32)
    return quiet(Learner(DataLoaders(dl, dl), TwoInputs(), F.cross_entropy, n_inp=2, lr=1e-2)), dl


def test_a_model_of_two_inputs(tmp_path):
    learn, dl = two_input_learner()
    learn.fit(1)
    inference = load_learner(learn.export(tmp_path / 'two.pt2'))
    assert inference.facts['n_inp'] == 2 and len(inference.facts['inputs']) == 2
    probs, targets = learn.get_preds(dl)
    assert all(torch.equal(a, b) for a, b in zip(inference.get_preds(dl), (probs, targets)))
    image, offset, target = dl.dataset[3]
    expected = learn.predict((image, offset))
    assert all(torch.equal(a, b) for a, b in zip(inference.predict((image, offset, target)), expected))


def digits_with_loss(loss_func):
    learn = digits_learner()
    learn.loss_func = loss_func
    return learn


class OwnActivation(nn.Module):
    "A loss that carries its own activation, as fastai's do: a function teachloop cannot name."
    activation = staticmethod(lambda pred: pred.softmax(dim=1))
    def forward(self, pred, target): return F.cross_entropy(pred, target)


@pytest.mark.parametrize('loss_func, activation, decodes', [
    (F.cross_entropy, 'softmax_over_classes', 'most_probable_class'),
    (nn.CrossEntropyLoss(), 'softmax_over_classes', 'most_probable_class'),
    (F.binary_cross_entropy_with_logits, 'sigmoid', 'above_half'),
    (nn.BCEWithLogitsLoss(), 'sigmoid', 'above_half'),
    (F.mse_loss, None, None)])
def test_the_facts_name_the_activation_get_preds_applies(tmp_path, loss_func, activation, decodes):
    learn = digits_with_loss(loss_func)
    path = learn.export(tmp_path / 'model.pt2')
    with zipfile.ZipFile(path) as archive:
        facts = json.loads(archive.read(next(n for n in archive.namelist() if n.endswith('extra/teachloop.json'))))
    assert (facts['activation'], facts['decodes']) == (activation, decodes)
    x = torch.rand(5, 1, 8, 8)
    learner_preds, _, learner_decoded = learn.get_preds([x], with_decoded=True)
    preds, targets, decoded = load_learner(path).get_preds([x], with_decoded=True)
    assert torch.equal(preds, learner_preds) and torch.equal(decoded, learner_decoded) and targets is None


def test_a_loss_with_an_activation_of_its_own_is_refused_before_anything_is_written(tmp_path):
    learn = digits_with_loss(OwnActivation())
    with pytest.raises(ValueError, match="cannot be saved by name"): learn.export(tmp_path / 'model.pt2')
    assert list(tmp_path.iterdir()) == []


def test_a_vocab_names_the_class_and_the_labels_that_are_on(trained, tmp_path):
    names = [f'digit {i}' for i in range(10)]
    single = load_learner(trained.export(tmp_path / 'one.pt2', vocab=names))
    assert single.named(torch.tensor(4)) == 'digit 4'
    multi_label = digits_with_loss(F.binary_cross_entropy_with_logits)
    multi = load_learner(multi_label.export(tmp_path / 'multi.pt2', vocab=names))
    on = torch.zeros(10, dtype=torch.bool)
    on[[1, 7]] = True
    assert multi.named(on) == ['digit 1', 'digit 7']
    assert multi.named(on[:7]) is not None and torch.equal(multi.named(on[:7]), on[:7])  # not one flag a label: as it is
    name, probs = multi.predict(torch.rand(1, 8, 8))
    assert name == [n for n, p in zip(names, probs.tolist()) if p > 0.5]


def test_files_that_are_not_exports_are_refused_clearly(tmp_path):
    torch.save({'model': {}}, tmp_path / 'weights.pt')
    (tmp_path / 'text.pt2').write_text('not an archive')
    for name in ('weights.pt', 'text.pt2'):
        with pytest.raises(ValueError, match='could not read'): load_learner(tmp_path / name)
    program = export_model(digits_cnn(), (torch.zeros(2, 1, 8, 8),))
    torch.export.save(program, tmp_path / 'plain.pt2')  # an export of torch's, without teachloop's facts
    with pytest.raises(ValueError, match='not written by `learn.export`'): load_learner(tmp_path / 'plain.pt2')


# ---- files written to run code: each is refused by `load_learner`, and would have run its code in torch's loader

def rewritten(path, out, edit):
    "A copy at `out` of the archive at `path`, the text of each entry ending in a key of `edit` changed by its function."
    with zipfile.ZipFile(path) as archive, zipfile.ZipFile(out, 'w') as copy:
        for info in archive.infolist():
            data = archive.read(info)
            for ending, change in edit.items():
                if info.filename.endswith(ending): data = change(data.decode()).encode()
            copy.writestr(info, data)
    return out


def marker_code(marker): return f"__import__('pathlib').Path({str(marker)!r}).touch()"


def test_a_shape_that_runs_python_is_refused_and_would_have_run(trained, tmp_path):
    marker = tmp_path / 'ran'
    def inject(text):
        shape = re.search(r'"expr_str": "(Symbol[^"]*)"', text).group(1)
        return text.replace(shape, f"({marker_code(marker)}, {shape})[1]".replace('"', '\\"'), 1)
    crafted = rewritten(trained.export(tmp_path / 'digits.pt2'), tmp_path / 'crafted.pt2', {'models/model.json': inject})
    with pytest.raises(ValueError, match='shape expression'): load_learner(crafted)
    assert not marker.exists()
    load_learner(crafted, trust=True)  # torch's loader evaluates it: the check above is not about nothing
    assert marker.exists()


def test_a_pickled_weight_is_refused(trained, tmp_path):
    def as_pickle(text):
        config = json.loads(text)
        next(iter(config['config'].values()))['use_pickle'] = True
        return json.dumps(config)
    crafted = rewritten(trained.export(tmp_path / 'digits.pt2'), tmp_path / 'crafted.pt2',
                        {'weights_config.json': as_pickle})
    with pytest.raises(ValueError, match='stored as a pickle'): load_learner(crafted)


def test_an_operator_outside_torch_ops_and_a_guard_are_refused(trained, tmp_path):
    path = trained.export(tmp_path / 'digits.pt2')
    def os_system(text): return text.replace('"torch.ops.aten.relu.default"', '"torch.os.system"', 1)
    def guard(text):
        program = json.loads(text)
        program['guards_code'] = ["__import__('os').getpid() > 0"]
        return json.dumps(program)
    for name, edit, refusal in (('os.pt2', os_system, "operator 'torch.os.system'"), ('guard.pt2', guard, 'is Python')):
        crafted = rewritten(path, tmp_path / name, {'models/model.json': edit})
        with pytest.raises(ValueError, match=re.escape(refusal)): check_archive(crafted)
    check_archive(path)  # the learner's own file passes


def test_example_inputs_that_need_a_full_unpickle_are_refused(trained, tmp_path):
    class Marker:
        def __reduce__(self): return (print, ('unpickled',))
    path = trained.export(tmp_path / 'digits.pt2')
    crafted = tmp_path / 'crafted.pt2'
    with zipfile.ZipFile(path) as archive, zipfile.ZipFile(crafted, 'w') as copy:
        for info in archive.infolist():
            data = archive.read(info)
            if '/sample_inputs/' in info.filename:
                buffer = io.BytesIO()
                torch.save(((Marker(),), {}), buffer)
                data = buffer.getvalue()
            copy.writestr(info, data)
    with pytest.raises(ValueError, match='pickle of more than tensors'): check_archive(crafted)


# ---- sizes past the batch, and models the trace cannot follow

class Tokens(nn.Module):
    "Scores of 3 classes for a sequence of tokens: embedding, a convolution along the sequence, the mean over it."
    def __init__(self, vocab=20, width=16, n_classes=3):
        super().__init__()
        self.embed, self.conv = nn.Embedding(vocab, width), nn.Conv1d(width, width, 3, padding=1)
        self.out = nn.Linear(width, n_classes)
    def forward(self, tokens): return self.out(self.conv(self.embed(tokens).transpose(1, 2)).relu().mean(-1))


def sequence_learner(model, with_lengths=False, width=15):
    "A learner on 64 random sequences of `width` tokens (and their lengths, as a second input) with 3 classes."
    torch.manual_seed(0)
    tokens, lengths = torch.randint(1, 20, (64, width)), torch.randint(3, width + 1, (64,))
    tokens[torch.arange(width) >= lengths[:, None]] = 0
    tensors = (tokens, lengths) if with_lengths else (tokens,)
    dl = DataLoader(TensorDataset(*tensors, tokens[:, 0] % 3), batch_size=16)
    return quiet(Learner(DataLoaders(dl, dl), model, F.cross_entropy, n_inp=len(tensors), lr=1e-2))


def test_a_sequence_model_exported_at_width_15_takes_width_9_after_loading(tmp_path):
    learn = sequence_learner(Tokens())
    learn.fit(1)
    inference = load_learner(learn.export(tmp_path / 'tokens.pt2'))
    assert inference.facts['inputs'] == [{'shape': [[2, None]], 'dtype': 'int64'}]
    nine = torch.randint(0, 20, (5, 9))
    with torch.no_grad(): expected = learn.model.eval()(nine).softmax(-1)
    assert torch.allclose(inference.get_preds([nine])[0], expected, rtol=0, atol=1e-6)  # float32, other shapes' kernels
    with pytest.raises(ValueError, match=r"shape \(n, 2\.\.\) and dtype int64.*got shape \(5, 1\)"):
        inference.get_preds([nine[:, :1]])  # one token: below the program's range


def test_dynamic_batch_keeps_the_sizes_of_the_example_and_says_so(tmp_path):
    learn = sequence_learner(Tokens())
    inference = load_learner(learn.export(tmp_path / 'tokens.pt2', dynamic='batch'))
    assert inference.facts['inputs'] == [{'shape': [15], 'dtype': 'int64'}]
    with pytest.raises(ValueError, match=r"shape \(n, 15\) and dtype int64.*got shape \(5, 9\)"):
        inference.get_preds([torch.randint(0, 20, (5, 9))])


@pytest.mark.parametrize('dynamic', ['free', [1], [(2,)], [(0,)], [(-1,)], [(1,), (1,)]])
def test_a_wrong_dynamic_is_refused_before_the_trace(tmp_path, dynamic):
    learn = sequence_learner(Tokens())
    with pytest.raises(ValueError, match=r"dynamic must be 'auto', 'batch', or one list of dimensions per input"):
        learn.export(tmp_path / 'tokens.pt2', dynamic=dynamic)
    assert list(tmp_path.iterdir()) == []


class PlainGRU(nn.Module):
    "A GRU over a batch of sequences of one length: a trace unrolls it, one step per position."
    def __init__(self, vocab=20, hidden=16, n_classes=3):
        super().__init__()
        self.embed, self.gru, self.out = nn.Embedding(vocab, hidden), nn.GRU(hidden, hidden, batch_first=True), nn.Linear(hidden, n_classes)
    def forward(self, tokens): return self.out(self.gru(self.embed(tokens))[1][-1])


class PackedGRU(PlainGRU):
    "A GRU over padded sequences of different lengths, read through pack_padded_sequence: no trace can follow it."
    def forward(self, tokens, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        return self.out(self.gru(packed)[1][-1])


def test_auto_leaves_fixed_what_the_trace_fixes_and_a_size_asked_free_fails_naming_the_way_out(tmp_path):
    learn = sequence_learner(PlainGRU())
    assert load_learner(learn.export(tmp_path / 'gru.pt2')).facts['inputs'] == [{'shape': [15], 'dtype': 'int64'}]
    with pytest.raises(RuntimeError, match=r"init_args=") as caught: learn.export(tmp_path / 'free.pt2', dynamic=[(1,)])
    assert 'specialized it to be a constant (15)' in str(caught.value.__cause__)
    assert not (tmp_path / 'free.pt2').exists()


GRU_ARGS = {'vocab': 20, 'hidden': 16, 'n_classes': 3}


def exported_weights(tmp_path, model=None, **kwargs):
    learn = sequence_learner(model or PackedGRU(), with_lengths=True)
    learn.fit(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        path = learn.export(tmp_path / 'gru.pt2', init_args=GRU_ARGS, **kwargs)
    return learn, path, [str(w.message) for w in caught if 'init_args' in str(w.message)]


def test_without_init_args_a_model_that_cannot_trace_is_refused_naming_them(tmp_path):
    learn = sequence_learner(PackedGRU(), with_lengths=True)
    with pytest.raises(RuntimeError, match=r"learn.export\(path, init_args=\{\.\.\.\}\)"): learn.export(tmp_path / 'gru.pt2')
    assert list(tmp_path.iterdir()) == []


def test_with_init_args_its_weights_and_class_are_written_with_a_warning_and_load_without_pickle(tmp_path):
    learn, path, said = exported_weights(tmp_path)
    assert len(said) == 1 and 'test_inference:PackedGRU' in said[0] and 'could not trace' in said[0]
    assert is_weights_file(path) and not zipfile.is_zipfile(path)
    model, facts = read_weights_export(path)
    assert facts['kind'] == 'weights' and facts['model'] == 'test_inference:PackedGRU' and facts['init_args'] == GRU_ARGS
    # found by trying: the length is free, the lengths have no size past the batch
    assert facts['inputs'] == [{'shape': [[1, None]], 'dtype': 'int64'}, {'shape': [], 'dtype': 'int64'}]
    assert not model.training and all(torch.equal(v, learn.model.state_dict()[k]) for k, v in model.state_dict().items())


FRESH_WEIGHTS = """
import sys, torch
from teachloop.inference import load_learner
learn = load_learner(sys.argv[1])
tokens, lengths = torch.load(sys.argv[2], weights_only=True)
torch.save(learn.get_preds([(tokens, lengths)])[0], sys.argv[3])
"""


def test_a_fresh_process_that_can_import_the_class_predicts_on_other_widths_as_the_learner(tmp_path):
    "The class comes from a module of the user's (this file, on the fresh process's path); the file from safetensors."
    learn, path, _ = exported_weights(tmp_path)
    tokens, lengths = torch.randint(1, 20, (6, 9)), torch.tensor([9, 3, 5, 8, 9, 4])
    torch.save((tokens, lengths), tmp_path / 'short.pt')
    env = {**os.environ, 'OMP_NUM_THREADS': str(torch.get_num_threads()),
           'PYTHONPATH': os.pathsep.join([os.path.dirname(__file__), os.environ.get('PYTHONPATH', '')])}
    done = subprocess.run([sys.executable, '-c', FRESH_WEIGHTS, str(path), str(tmp_path / 'short.pt'), str(tmp_path / 'p.pt')],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad(): expected = learn.model.eval()(tokens, lengths).softmax(-1)
    assert torch.equal(torch.load(tmp_path / 'p.pt', weights_only=True), expected)


def test_the_inputs_of_a_weights_file_are_checked_too(tmp_path):
    _, path, _ = exported_weights(tmp_path)
    inference = load_learner(path)
    with pytest.raises(ValueError, match=r"input 1 should be a batch of shape \(n\) and dtype int64"):
        inference.get_preds([(torch.randint(1, 20, (2, 9)), torch.tensor([9., 4.]))])
    (tmp_path / 'fixed').mkdir()
    fixed = load_learner(exported_weights(tmp_path / 'fixed', dynamic='batch')[1])  # no size free but the batch's
    with pytest.raises(ValueError, match=r"input 0 should be a batch of shape \(n, 15\)"):
        fixed.get_preds([(torch.zeros(2, 9).long(), torch.tensor([9, 4]))])
    (tmp_path / 'listed').mkdir()  # the free sizes given per input: the tokens' length, nothing of the lengths'
    listed = load_learner(exported_weights(tmp_path / 'listed', dynamic=[(1,), ()])[1])
    assert [i['shape'] for i in listed.facts['inputs']] == [[[1, None]], []]


class Unbuildable(PackedGRU):
    def __init__(self, vocab=20, hidden=16, n_classes=3, callback=None): super().__init__(vocab, hidden, n_classes)


@pytest.mark.parametrize('model, init_args, says', [
    (PackedGRU(), {'vocab': 20, 'hidden': 8, 'n_classes': 3}, 'do not fit this model'),
    (PackedGRU(), {'vocab': 20, 'hidden': 16, 'classes': 3}, r"PackedGRU\(\*\*init_args\) fails: TypeError"),
    (Unbuildable(), {**GRU_ARGS, 'callback': print}, 'init_args must be JSON values'),
])
def test_init_args_that_do_not_rebuild_the_model_are_refused_before_the_trace(tmp_path, model, init_args, says):
    learn = sequence_learner(model, with_lengths=True)
    with pytest.raises(ValueError, match=says): learn.export(tmp_path / 'gru.pt2', init_args=init_args)
    assert list(tmp_path.iterdir()) == []


def test_a_class_no_other_process_can_import_is_refused(tmp_path):
    class Local(PackedGRU): pass
    learn = sequence_learner(Local(), with_lengths=True)
    with pytest.raises(ValueError, match='move it into a module of your own'): learn.export(tmp_path / 'g.pt2', init_args=GRU_ARGS)


def test_a_class_from_a_module_of_any_name_is_named_by_its_path(tmp_path, monkeypatch):
    "A module whose name sorts before '__main__' (a capital first letter): its class is importable, and named so."
    (tmp_path / 'Zoo.py').write_text('from torch import nn\nclass Net(nn.Linear): pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    from Zoo import Net
    assert 'Zoo' < '__main__' and class_path(Net(2, 1)) == 'Zoo:Net' and model_class('Zoo:Net') is Net


def test_a_weights_file_naming_anything_but_a_module_class_is_refused_before_calling_it(tmp_path):
    import safetensors.torch
    marker = tmp_path / 'ran'
    _, path, _ = exported_weights(tmp_path)
    with open(path, 'rb') as f: header = json.loads(f.read(8 + int.from_bytes(open(path, 'rb').read(8), 'little'))[8:])
    facts = json.loads(header['__metadata__']['teachloop.json'])
    crafted = tmp_path / 'crafted.pt2'
    facts.update(model='pathlib:Path.touch', init_args={'self': str(marker)})
    tensors = {k: v for k, v in read_weights_export(path)[0].state_dict().items()}
    crafted.write_bytes(safetensors.torch.save(tensors, metadata={'teachloop.json': json.dumps(facts)}))
    with pytest.raises(ValueError, match='not a torch.nn.Module class'): load_learner(crafted)
    assert not marker.exists()


def test_the_archive_check_stays_exact_on_programs_with_free_sizes(tmp_path):
    "Free sizes add size operators and range expressions to the graph: each still one of torch's, or arithmetic."
    path = sequence_learner(Tokens()).export(tmp_path / 'tokens.pt2')
    check_archive(path)
    def os_system(text): return text.replace('"torch.ops.aten.embedding.default"', '"torch.os.system"', 1)
    crafted = rewritten(path, tmp_path / 'os.pt2', {'models/model.json': os_system})
    with pytest.raises(ValueError, match=re.escape("operator 'torch.os.system'")): check_archive(crafted)
    def near_miss(text): return text.replace('"torch.ops.aten.embedding.default"', '"torch.ops.aten.embedding.default.x"', 1)
    with pytest.raises(ValueError, match='is not one of torch'):
        check_archive(rewritten(path, tmp_path / 'near.pt2', {'models/model.json': near_miss}))


def test_an_operator_that_starts_like_one_of_torchs_and_goes_on_is_refused(trained, tmp_path):
    "The name must be an operator's whole: one that only starts like one (a prefix) is refused by `load_learner`."
    path = trained.export(tmp_path / 'digits.pt2')
    allowed = ['torch.ops.aten.relu.default', 'torch.sym_float', 'math.sqrt', '_operator.getitem']
    for i, name in enumerate(f'{start}{rest}' for start in allowed for rest in ('.system', "('echo')")):
        def swap(text): return text.replace('"torch.ops.aten.relu.default"', json.dumps(name), 1)
        crafted = rewritten(path, tmp_path / f'crafted-{i}.pt2', {'models/model.json': swap})
        with pytest.raises(ValueError, match=re.escape(f"operator {name!r} is not one of torch's")): load_learner(crafted)
    load_learner(path)  # the learner's own file, with those operators whole, loads


# ---- the example a program is traced with (tests found missing by mutation testing, tools/mutate.py)

def test_an_example_of_one_item_still_gives_a_program_for_any_batch_size(trained, tmp_path):
    "Traced on one item alone, torch.export would fix the batch size at 1: the item is doubled for the trace."
    x = torch.rand(5, 1, 8, 8)
    learn = load_learner(trained.export(tmp_path / 'one.pt2', example=x[:1]))
    with torch.no_grad(): expected = trained.model.eval()(x).softmax(dim=1)
    assert torch.equal(learn.get_preds([(x, torch.zeros(5, dtype=torch.long))])[0], expected)


def test_an_example_batch_gives_its_inputs_to_the_trace(tmp_path):
    "Without `n_inp`, an example of several tensors is split as the learner splits a batch: all but the last are inputs."
    learn, dl = two_input_learner()
    learn.n_inp = None
    image, offset, target = next(iter(dl))
    inference = load_learner(learn.export(tmp_path / 'two.pt2', example=(image, offset, target)))
    assert len(inference.facts['inputs']) == 2 and inference.facts['inputs'][1]['shape'] == list(offset.shape[1:])


def test_an_inference_learner_runs_no_callback_of_a_fit(trained, tmp_path):
    "No recorder, no progress bar: predictions only (the model in evaluation mode)."
    inference = load_learner(trained.export(tmp_path / 'digits.pt2'))
    assert [type(cb).__name__ for cb in inference.learn.cbs] == ['TrainEvalCallback']


@pytest.mark.parametrize('facts', [{}, {'format': 'teachloop-inference-0'}])
def test_a_program_whose_facts_are_not_an_exports_is_refused(trained, tmp_path, facts):
    "A torch.export archive of another writer, or of another format of ours: refused before its program is used."
    from teachloop.inference import FACTS_FILE, read_export
    program, real = read_export(trained.export(tmp_path / 'digits.pt2'))
    other = {FACTS_FILE: json.dumps({**real, **facts} if facts else {})}
    torch.export.save(program, tmp_path / 'other.pt2', extra_files=other)
    with pytest.raises(ValueError, match='was not written by `learn.export`'): load_learner(tmp_path / 'other.pt2')


def test_the_archive_check_reads_the_program_not_the_files_beside_it(trained, tmp_path):
    "A JSON file an exporter kept beside the program (torch never runs it) may hold any names."
    from teachloop.inference import FACTS_FILE, read_export
    program, facts = read_export(trained.export(tmp_path / 'digits.pt2'))
    notes = {'target': 'my.own.notes', 'expr_str': 'os.getcwd()'}
    extra = {FACTS_FILE: json.dumps(facts), 'notes.json': json.dumps(notes)}
    torch.export.save(program, tmp_path / 'noted.pt2', extra_files=extra)
    noted, plain = (load_learner(tmp_path / name).get_preds(trained.dls.valid)[0]
                    for name in ('noted.pt2', 'digits.pt2'))
    assert torch.equal(noted, plain)


@pytest.mark.parametrize('facts', [None, {'format': 'teachloop-inference-2', 'kind': 'weights'},
                                   {'format': 'teachloop', 'kind': 'weights'},  # a format that sorts before ours too
                                   {'format': 'teachloop-inference', 'kind': 'program'}])
def test_a_weights_file_whose_facts_are_not_an_exports_is_refused(tmp_path, facts):
    "A safetensors file of another writer (or of another format or kind) is not loaded, whatever its tensors."
    import safetensors.torch
    from teachloop.inference import FACTS_FILE
    path = tmp_path / 'other.safetensors'
    metadata = None if facts is None else {FACTS_FILE: json.dumps({**facts, 'model': 'torch.nn.Linear', 'init_args': {}})}
    path.write_bytes(safetensors.torch.save({'weight': torch.zeros(2, 2)}, metadata=metadata))
    with pytest.raises(ValueError, match='was not written by `learn.export`'): load_learner(path)


def test_free_sizes_past_an_inputs_last_dimension_are_refused():
    from teachloop.inference import check_dynamic
    images = torch.zeros(2, 1, 8, 8)
    check_dynamic([[1, 3]], (images,))
    for beyond in (0, 4, 5):  # the batch, and dimensions the input does not have
        with pytest.raises(ValueError): check_dynamic([[beyond]], (images,))

"""Random states: seeding, reading, restoring and saving every generator a step may draw from."""
import random

import numpy as np
import pytest
import torch

from teachloop import random_state
from teachloop.random_state import rng_states, same_state, saveable_rng, set_rng_states


def test_rng_states_round_trip_through_a_file(tmp_path):
    saved = rng_states()
    torch.save(saveable_rng(saved), tmp_path / 'rng.pt')
    first = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_states(torch.load(tmp_path / 'rng.pt', weights_only=True))
    assert torch.equal(first[0], torch.rand(3)) and np.array_equal(first[1], np.random.rand(3)) and first[2] == random.random()
    assert set(rng_states(host=False)) <= {'torch', 'cuda'}


def test_rng_states_with_another_numpy_generator_round_trip_through_a_file(tmp_path):
    original = np.random.get_bit_generator()
    np.random.set_bit_generator(np.random.PCG64(5))
    try:
        saved = rng_states()
        assert saved['numpy'] == np.random.get_state(legacy=False)  # PCG64's state is a dict of numbers
        torch.save(saveable_rng(saved), tmp_path / 'rng.pt')
        first = np.random.rand(4)
        set_rng_states(torch.load(tmp_path / 'rng.pt', weights_only=True))
        assert np.array_equal(first, np.random.rand(4))
    finally: np.random.set_bit_generator(original)


@pytest.mark.parametrize('saved,present,restored,note', [
    (2, 2, [0, 1], None), (2, 1, [0], 'saved with 2 GPU'), (1, 2, [0], 'saved with 1 GPU'),
    (0, 1, [], 'saved without a GPU'), (1, 0, [], 'saved with 1 GPU')])
def test_random_states_from_a_machine_with_another_number_of_gpus(monkeypatch, saved, present, restored, note):
    "What fits is restored, the rest is said in a warning (checked on the CPU with the CUDA calls stood in for)."
    calls = []
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: present > 0)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: present)
    monkeypatch.setattr(torch.cuda, 'set_rng_state', lambda state, device: calls.append(device))
    states = {'torch': torch.get_rng_state(), 'cuda': [torch.zeros(16, dtype=torch.uint8)] * saved}
    if note is None:
        assert random_state.set_rng_states(states) == []
    else:
        with pytest.warns(UserWarning, match=note): random_state.set_rng_states(states)
    assert calls == restored


@pytest.mark.cuda
def test_a_cpu_checkpoint_resumes_on_the_gpu_with_a_note(tmp_path):
    states = random_state.rng_states()
    states.pop('cuda', None)
    with pytest.warns(UserWarning, match='without a GPU'): random_state.set_rng_states(states)

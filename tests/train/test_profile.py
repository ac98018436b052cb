"""The acceptance profile ``eyas train`` writes for its export (eyas.train.profile), read back by eyas.autotree."""

from __future__ import annotations

import torch

from eyas.autotree import load_profile
from eyas.formats.eagle3 import save_eagle3
from eyas.train.dataset import Example
from eyas.train.eagle3 import add_layers
from eyas.train.objectives import answer_text
from eyas.train.profile import write_profile
from tests.conftest import tiny_native
from tests.formats.test_eagle3_format import make_head


def test_answer_text_is_the_first_answer():
    ids = torch.arange(10)
    learn = torch.tensor([0, 0, 1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool)  # token t + 1 is an answer token
    text, first = answer_text(Example(ids, learn))
    assert first == 2 and torch.equal(text, ids[:6])  # the answer is tokens 3..5; the second turn is cut
    assert answer_text(Example(ids, torch.zeros(10, dtype=torch.bool))) is None


def test_written_profile_loads_and_a_no_op_layer_keeps_it(tmp_path):
    target = tiny_native("llama")
    g = torch.Generator().manual_seed(7)
    texts = [(torch.randint(0, target.config.vocab_size, (n,), generator=g), 3) for n in (14, 20)]
    profiles = []
    for name, layers in (("one", 1), ("two", 2)):
        head = add_layers(make_head(target.config), layers)
        save_eagle3(head, tmp_path / name, dtype=torch.float32)
        out = write_profile(tmp_path / name, target, head, texts, "random texts", depths=4, ranks=3)
        assert out == tmp_path / name / "profile.json"
        profile = load_profile(tmp_path / name)  # keyed to the weights just written: accepted
        assert profile is not None and len(profile.rank_accept) == 4 and len(profile.rank_accept[0]) == 3
        profiles.append(profile.rank_accept)
    assert profiles[0] == profiles[1]  # the added layer is a no-op until trained
    (tmp_path / "two" / "model.safetensors").write_bytes((tmp_path / "one" / "model.safetensors").read_bytes())
    assert load_profile(tmp_path / "two") is None  # other weights: the profile no longer applies

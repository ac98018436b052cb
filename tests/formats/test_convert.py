"""``eyas convert``: every layout round-trips (convert -> load -> generate identical to the source head),
and bad input ends with one ``eyas: error:`` line and exit code 2.

The heads are random (seeded) heads for tiny random targets, saved in float32 so that a conversion
is exact; the target is a saved tiny Llama directory passed as ``--verifier``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eyas.cli import main
from eyas.decode import DecodeConfig, SpecDecoder
from eyas.drafters.eagle import EagleDrafter, EagleHead, load_eagle_head
from eyas.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head
from eyas.drafters.medusa import MedusaDrafter, medusa_heads_for
from eyas.formats import read_weights, write_json
from eyas.formats.convert import LAYOUTS, ConvertRequest, convert
from eyas.formats.eagle1 import save_eagle1
from eyas.formats.eagle3 import load_eagle3, save_eagle3
from eyas.formats.gguf_eagle3 import load_eagle3_gguf, save_eagle3_gguf
from eyas.formats.medusa import load_medusa, save_medusa
from eyas.models.config import ModelConfig
from tests.conftest import stderr_lines


# ---- heads and generation -------------------------------------------------------------------------
def eagle3_head(cfg: ModelConfig, seed: int = 0) -> Eagle3Head:
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(cfg, 128, (0, 1, 2)))
    head.set_draft_vocab(torch.randperm(cfg.vocab_size, generator=g)[:128])
    _randomise(head, g)
    return head.eval().requires_grad_(False)


def eagle1_head(cfg: ModelConfig, bias: bool, seed: int = 0) -> EagleHead:
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(ModelConfig(**{**cfg.__dict__, "num_layers": 1}), bias=bias)
    _randomise(head, g)
    return head.eval().requires_grad_(False)


def _randomise(module: torch.nn.Module, g: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in module.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + (0.2 if "norm" in name else 0.1) * torch.randn(p.shape, generator=g))


def run(target, drafter, prompt, n: int = 16) -> list[int]:
    dec = SpecDecoder(target, drafter, DecodeConfig(max_new_tokens=n))
    return [t for ev in dec.generate(prompt) for t in ev.tokens.tolist()] + [dec.stats.steps, dec.stats.accepted]


@pytest.fixture
def setup(tiny, tmp_path):
    """(target NativeLlama, target dir, prompt)."""
    tiny.hf("llama").save_pretrained(tmp_path / "target")
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0))
    return tiny.native("llama"), tmp_path / "target", prompt


def cli(*args) -> int:
    return main(["convert", *map(str, args)])


# ---- round trips ----------------------------------------------------------------------------------
def test_eagle3_layouts_round_trip(setup, tmp_path):
    target, tdir, prompt = setup
    head = eagle3_head(target.config)
    save_eagle3(head, tmp_path / "src", target_name=str(tdir), dtype=torch.float32)
    want = run(target, Eagle3Drafter(target_model=target, head=head, tree="dynamic:4,4,12"), prompt)
    outs = {"eagle3": tmp_path / "e3", "speculators": tmp_path / "spec"}
    for layout, out in outs.items():
        assert cli(tmp_path / "src", out, "--to", layout) == 0
        got = load_eagle3(out, target.config)
        assert run(target, Eagle3Drafter(target_model=target, head=got, tree="dynamic:4,4,12"), prompt) == want
    # --to gguf copies the vocabulary from the target's GGUF, which a tiny target has not: the same
    # writer without one (test_shipped_head_converts_for_the_embedded_model runs the CLI path)
    outs["gguf"] = save_eagle3_gguf(load_eagle3(tmp_path / "src", target.config), tmp_path / "h.gguf")
    got = load_eagle3_gguf(outs["gguf"], target.config)
    assert run(target, Eagle3Drafter(target_model=target, head=got, tree="dynamic:4,4,12"), prompt) == want
    # and back: gguf -> eagle3 and speculators -> eagle3 (the recorded target is found again)
    assert cli(outs["gguf"], tmp_path / "back", "--to", "eagle3", "--verifier", tdir) == 0
    assert cli(outs["speculators"], tmp_path / "back2", "--to", "eagle3") == 0
    for back in ("back", "back2"):
        got = load_eagle3(tmp_path / back, target.config)
        assert run(target, Eagle3Drafter(target_model=target, head=got, tree="dynamic:4,4,12"), prompt) == want
    sd_src, sd_back = read_weights(tmp_path / "src"), read_weights(tmp_path / "back")
    assert all(torch.equal(sd_src[k], sd_back[k]) for k in sd_src)


@pytest.mark.parametrize("layout, bias", [("eagle1", True), ("eagle1", False), ("eagle1-vllm", False)])
def test_eagle1_layouts_round_trip(setup, tmp_path, layout, bias):
    target, tdir, prompt = setup
    head = eagle1_head(target.config, bias)
    save_eagle1(head, tmp_path / "src", target_name=str(tdir), dtype=torch.float32)
    want = run(target, EagleDrafter(target_model=target, head=head, tree="dynamic:4,4,12"), prompt)
    assert cli(tmp_path / "src", tmp_path / "out", "--to", layout) == 0
    got = load_eagle_head(tmp_path / "out", target.config, torch.float32)
    assert run(target, EagleDrafter(target_model=target, head=got, tree="dynamic:4,4,12"), prompt) == want


@pytest.mark.parametrize("src_layout", ["vllm", "medusa"])
@pytest.mark.parametrize("to", ["medusa", "medusa-vllm"])
def test_medusa_layouts_round_trip(setup, tmp_path, src_layout, to):
    target, tdir, prompt = setup
    heads = medusa_heads_for(target, num_heads=3, init="random", seed=2)
    save_medusa(heads, tmp_path / "src", layout=src_layout, target_name=str(tdir))
    want = run(target, MedusaDrafter(target_model=target, heads=heads, tree="dynamic:4,3,12"), prompt)
    assert cli(tmp_path / "src", tmp_path / "out", "--to", to) == 0
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tdir.resolve())  # issue 13, 7: never empty
    got = load_medusa(tmp_path / "out", target.config)
    assert run(target, MedusaDrafter(target_model=target, heads=got, tree="dynamic:4,3,12"), prompt) == want


def test_dtype_is_kept_unless_asked(setup, tmp_path):
    target, tdir, _ = setup
    save_eagle3(eagle3_head(target.config), tmp_path / "src", target_name=str(tdir), dtype=torch.bfloat16)
    convert(ConvertRequest(tmp_path / "src", tmp_path / "a", "speculators"))
    assert read_weights(tmp_path / "a")["fc.weight"].dtype == torch.bfloat16
    convert(ConvertRequest(tmp_path / "src", tmp_path / "b", "eagle3", dtype="float32"))
    assert read_weights(tmp_path / "b")["fc.weight"].dtype == torch.float32
    assert sorted(LAYOUTS) == sorted(["eagle3", "speculators", "gguf", "eagle1", "eagle1-vllm", "medusa",
                                      "medusa-vllm"])


# ---- refusals and bad input: one `eyas: error:` line, exit code 2 ---------------------------------
def _one_error_line(capsys, code: int, match: str) -> None:
    err = stderr_lines(capsys.readouterr().err)
    assert code == 2 and len(err) == 1 and err[0].startswith("eyas: error: "), err
    assert match in err[0], err[0]


def test_missing_path(capsys, tmp_path):
    _one_error_line(capsys, cli(tmp_path / "nope", tmp_path / "out", "--to", "eagle3"), "no such head")


def test_corrupt_safetensors(setup, tmp_path, capsys):
    target, tdir, _ = setup
    save_eagle3(eagle3_head(target.config), tmp_path / "src", target_name=str(tdir))
    f = tmp_path / "src" / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # an interrupted download
    _one_error_line(capsys, cli(tmp_path / "src", tmp_path / "out", "--to", "speculators"), "not a readable")


def test_unknown_layouts(setup, tmp_path, capsys):
    target, tdir, _ = setup
    save_eagle3(eagle3_head(target.config), tmp_path / "src", target_name=str(tdir))
    _one_error_line(capsys, cli(tmp_path / "src", tmp_path / "out", "--to", "onnx"), "unknown layout 'onnx'")
    (tmp_path / "odd").mkdir()
    write_json(tmp_path / "odd" / "config.json", {"model_type": "llama"})
    from eyas.formats import save_tensors

    save_tensors({"some.weight": torch.zeros(2, 2)}, tmp_path / "odd" / "model.safetensors")
    _one_error_line(capsys, cli(tmp_path / "odd", tmp_path / "out", "--to", "eagle3"), "no head layout")


def test_unsupported_architecture(setup, tmp_path, capsys):
    """A speculators draft whose layer is not a Llama layer (issue 13, 6), and EAGLE-1 -> EAGLE-3."""
    target, tdir, _ = setup
    save_eagle3(eagle3_head(target.config), tmp_path / "src", target_name=str(tdir), speculators=True)
    cfg = json.loads((tmp_path / "src" / "config.json").read_text())
    cfg["transformer_layer_config"]["model_type"] = "gpt_oss"
    write_json(tmp_path / "src" / "config.json", cfg)
    _one_error_line(capsys, cli(tmp_path / "src", tmp_path / "out", "--to", "eagle3"), "'gpt_oss' decoder layer")
    save_eagle1(eagle1_head(target.config, True), tmp_path / "e1", target_name=str(tdir))
    _one_error_line(capsys, cli(tmp_path / "e1", tmp_path / "out", "--to", "gguf"), "holds an EAGLE-1 head")


def test_what_a_layout_cannot_express_is_refused(setup, tmp_path, capsys):
    target, tdir, _ = setup
    save_eagle1(eagle1_head(target.config, bias=True), tmp_path / "e1", target_name=str(tdir))
    _one_error_line(capsys, cli(tmp_path / "e1", tmp_path / "out", "--to", "eagle1-vllm"), "nonzero bias")
    save_eagle3(eagle3_head(target.config), tmp_path / "e3", target_name=str(tdir))
    _one_error_line(capsys, cli(tmp_path / "e3", tmp_path / "x.gguf", "--to", "gguf"), "has no GGUF")
    _one_error_line(capsys, cli(tmp_path / "e3", tmp_path / "x", "--to", "gguf"), "give OUT a .gguf name")
    _one_error_line(capsys, cli(tmp_path / "e3", tmp_path / "x", "--to", "eagle3", "--verifier", "no/such-model"),
                    "not in the local Hugging Face cache")


def test_no_recorded_target_needs_verifier(setup, tmp_path, capsys):
    target, _, _ = setup
    save_eagle3(eagle3_head(target.config), tmp_path / "src")  # no target_name
    _one_error_line(capsys, cli(tmp_path / "src", tmp_path / "out", "--to", "speculators"), "pass --verifier")


@pytest.mark.slow
def test_shipped_head_converts_for_the_embedded_model(tmp_path, default_target):
    """The shipped head -> every EAGLE-3 layout, with the verifier recorded in the head (embedded)."""
    src = Path(__file__).resolve().parents[2] / "eyas" / "heads" / "smollm2-135m-instruct-eagle3"
    assert cli(src, tmp_path / "h.gguf", "--to", "gguf") == 0
    assert cli(src, tmp_path / "spec", "--to", "speculators") == 0
    spec = json.loads((tmp_path / "spec" / "config.json").read_text())["speculators_config"]["verifier"]
    assert spec == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "architectures": ["LlamaForCausalLM"]}
    cfg = default_target.model.config
    a = load_eagle3(src, cfg)
    for got in (load_eagle3_gguf(tmp_path / "h.gguf", cfg), load_eagle3(tmp_path / "spec", cfg)):
        assert all(torch.equal(v, got.state_dict()[k]) for k, v in a.state_dict().items())

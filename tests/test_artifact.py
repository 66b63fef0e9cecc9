import json
import socket

import pytest
import torch
from safetensors.torch import save_file

from oscarkv import QuantConfig
from oscarkv.calibration.artifact import FORMAT_VERSION, RotationArtifact
from oscarkv.errors import ArtifactError, OscarError
from oscarkv.methods import data_free_artifact
from oscarkv.models import model_identity
from tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture()
def artifact(model):
    return data_free_artifact(model, "hadamard", QuantConfig(group_size=32))


def test_roundtrip(tmp_path, artifact, model):
    path = artifact.save(tmp_path / "rot.safetensors")
    loaded = RotationArtifact.load(path)
    assert loaded.method == "hadamard" and loaded.group_size == 32
    assert loaded.model == artifact.model
    for a, b in zip(artifact.layers, loaded.layers):
        assert torch.equal(a.k_rotation, b.k_rotation) and torch.equal(a.v_eigenvalues, b.v_eigenvalues)
    loaded.check_model(model_identity(model))


def test_missing_file(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist.*oscarkv calibrate"):
        RotationArtifact.load(tmp_path / "nope.safetensors")


@pytest.mark.parametrize("cut", [0, 10, 100, -50])
def test_truncated_or_garbage_file(tmp_path, artifact, cut):
    path = artifact.save(tmp_path / "rot.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(ArtifactError, match="corrupt or truncated|missing|re-run"):
        RotationArtifact.load(path)


def test_not_an_oscarkv_file(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(ArtifactError, match="not an oscarkv rotations artifact"):
        RotationArtifact.load(path)


def test_other_format_version_names_the_command(tmp_path, artifact):
    artifact.format_version = FORMAT_VERSION + 1
    path = tmp_path / "rot.safetensors"
    artifact.save(path)
    with pytest.raises(ArtifactError, match="format version .*oscarkv calibrate"):
        RotationArtifact.load(path)


def test_other_model_rejected(artifact):
    other = tiny_model("llama", seed=1)
    with pytest.raises(ArtifactError, match="another model.*weights differ"):
        artifact.check_model(model_identity(other))
    with pytest.raises(ArtifactError, match="another model.*head_dim"):
        artifact.check_model(model_identity(tiny_model("llama", head_dim=16)))


def test_non_orthogonal_rotation_rejected_at_save_and_load(tmp_path, artifact):
    path = artifact.save(tmp_path / "good.safetensors")
    artifact.layers[1].v_rotation = artifact.layers[1].v_rotation * 1.01
    with pytest.raises(ArtifactError, match="layers.1.v_rotation is not orthogonal"):
        artifact.save(tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()
    # A file edited behind our back is caught at load.
    tensors = {}
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    tensors["layers.0.k_rotation"] = tensors["layers.0.k_rotation"] * 2
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(ArtifactError, match="layers.0.k_rotation is not orthogonal"):
        RotationArtifact.load(path)


def test_failed_save_leaves_no_file(tmp_path, artifact, monkeypatch):
    import oscarkv.calibration.artifact as module

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module, "save_file", boom)
    with pytest.raises(OSError):
        artifact.save(tmp_path / "rot.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_metadata_is_json_with_provenance(tmp_path, artifact):
    from safetensors import safe_open

    path = artifact.save(tmp_path / "rot.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["oscarkv"])
    assert meta["format_version"] == FORMAT_VERSION
    assert meta["model"]["head_dim"] == 32 and meta["clip_ratio_k"] == 0.96
    assert "calibration" in meta


def test_one_key_rotation_per_kv_head_roundtrips_and_is_checked(tmp_path, artifact):
    """k_rotation may be [Hkv, d, d]; another head count, or a non-orthogonal head, is refused."""
    hkv, d = artifact.model.num_kv_heads, artifact.model.head_dim
    heads = torch.stack([torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].float() for _ in range(hkv)])
    artifact.layers[0].k_rotation = heads
    loaded = RotationArtifact.load(artifact.save(tmp_path / "heads.safetensors"))
    assert torch.equal(loaded.layers[0].k_rotation, heads)
    artifact.layers[0].k_rotation = torch.cat([heads, heads[:1]])
    with pytest.raises(ArtifactError, match=rf"layers.0.k_rotation has shape \({hkv + 1}, {d}, {d}\)"):
        artifact.save(tmp_path / "bad.safetensors")
    artifact.layers[0].k_rotation = heads.clone()
    artifact.layers[0].k_rotation[1] *= 1.01
    with pytest.raises(ArtifactError, match=r"layers.0.k_rotation\[1\] is not orthogonal"):
        artifact.save(tmp_path / "bad.safetensors")
    artifact.layers[0].k_rotation = heads[0]
    artifact.layers[0].v_rotation = heads  # values take one rotation per layer (it is folded into the weights)
    with pytest.raises(ArtifactError, match="layers.0.v_rotation has shape"):
        artifact.save(tmp_path / "bad.safetensors")


def test_lloyd_max_inner_levels_roundtrip_and_are_checked(tmp_path, artifact):
    artifact.layers[0].choice.update(inner_k=0.38, inner_v=None, bits_k=2, bits_v=2)
    artifact.layers[1].choice.update(inner_k=0.4, bits_k=4)  # an INT4 stream reads uniform levels
    loaded = RotationArtifact.load(artifact.save(tmp_path / "rot.safetensors"))
    assert loaded.layers[0].inner("k") == 0.38 and loaded.layers[0].inner("v") is None
    assert loaded.layers[1].inner("k") is None
    artifact.layers[0].choice["inner_v"] = 0.7
    with pytest.raises(ArtifactError, match="inner level for its v stream"):
        artifact.save(tmp_path / "bad.safetensors")


def test_commands_refuse_an_output_path_they_cannot_write_before_their_work(tmp_path, capsys, monkeypatch):
    """A calibration's --out, an evaluation's --plot or a benchmark's --save is written after minutes of work; a
    path that cannot take it fails first, in one line, before anything loads."""
    import argparse
    import os

    from oscarkv.cli import check_outputs, main

    a_file, a_dir = tmp_path / "a_file", tmp_path / "a_dir"
    a_file.write_text("x")
    a_dir.mkdir()
    for args, line in [
        (["calibrate", "smollm2-135m", "--out", str(a_dir)],
         f"--out {a_dir}: is a directory; pass a file name, such as {a_dir / 'rot.safetensors'}."),
        (["calibrate", "smollm2-135m", "--out", str(a_file / "rot.safetensors")],
         f"--out {a_file / 'rot.safetensors'}: {a_file} is a file, not a directory; pass another path."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--plot", str(a_dir)],
         f"--plot {a_dir}: is a directory; pass a file name, such as {a_dir / 'plot.png'}."),
        (["bench", "decode", "--save", str(a_file / "new" / "r.json")],
         f"--save {a_file / 'new' / 'r.json'}: {a_file} is a file, not a directory; pass another path."),
        (["demo", "--out", str(a_file)], f"--out {a_file}: a file of that name exists; pass a directory."),
    ]:
        capsys.readouterr()
        assert main(args) == 2, args
        assert capsys.readouterr().err.strip().splitlines() == [f"oscarkv: error: {line}"], args

    # Paths whose directories do not exist yet pass (they are made when written), as does an existing file.
    check_outputs(argparse.Namespace(out=str(tmp_path / "new" / "deeper" / "rot.safetensors"), plot=str(a_file)))
    check_outputs(argparse.Namespace(out=str(tmp_path / "new" / "demo"), output_dirs=("out",)))
    denied = {str(tmp_path)}
    monkeypatch.setattr(os, "access", lambda path, mode: str(path) not in denied)
    with pytest.raises(OscarError, match="cannot write there"):
        check_outputs(argparse.Namespace(out=str(tmp_path / "new" / "rot.safetensors")))


def test_arguments_that_depend_on_the_model_are_checked_before_its_weights_load(tmp_path, artifact, capsys,
                                                                                 monkeypatch):
    """A group size, clip ratio, calibration option, count, context or artifact that cannot fit the model is refused
    from the model's config alone (`models.model_config`), by the CLI's calibrate, eval and serve commands and by
    `oscarkv.load`: `models.load_model`, replaced here, is never reached. So are a missing or empty --text, and a
    --port that serve cannot listen on.
    The artifact of the tiny test model has SmolLM2's model type but another depth."""
    from oscarkv import models
    from oscarkv.cli import main

    from oscarkv.evaluation import code

    def no_loading(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before its arguments were checked")

    def no_problems(*args, **kwargs):
        raise AssertionError("HumanEval was loaded (fetched, the first time) before the arguments were checked")

    models.model_config("smollm2-135m")  # a first run on a machine fetches and converts the model's files, with bars
    monkeypatch.setattr(models, "load_model", no_loading)
    monkeypatch.setattr(code, "load_problems", no_problems)
    tiny = str(artifact.save(tmp_path / "tiny.safetensors"))
    mismatch = ("This rotations artifact was made for another model: num_layers is 2 in the artifact but 30 in the "
                "model. Calibrate one for this model with `oscarkv calibrate MODEL --out rot.safetensors`.")
    out = str(tmp_path / "rot.safetensors")
    held = socket.socket()  # a port something else listens on
    held.bind(("127.0.0.1", 0))
    held.listen()
    held_port = held.getsockname()[1]
    missing, empty = str(tmp_path / "no-such.txt"), tmp_path / "empty.txt"
    empty.write_text("\n")
    for args, line in [
        (["calibrate", "smollm2-135m", "--out", out, "--text", missing],
         f"text {missing!r} is neither a file nor a built-in text; use a path or one of wiki, news."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--text", str(empty)],
         f"the text [{str(empty)!r}] is empty; pass a file with prose in it."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--text", missing],
         f"text {missing!r} is neither a file nor a built-in text; use a path or one of wiki, news."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--text", str(empty)],
         f"the text [{str(empty)!r}] is empty; pass a file with prose in it."),
        (["bench", "serve", "--url", "http://127.0.0.1:9", "--text", str(empty)],
         f"the text [{str(empty)!r}] is empty; pass a file with prose in it."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--context", "16"],
         "context 16 leaves no position whose history reaches the INT2 region (sink 64 + recent 256); use a longer "
         "--context."),
        (["calibrate", "smollm2-135m", "--out", out, "--group-size", "48"],
         "group_size=48 must be a power of two >= 4 (e.g. 64 or 128)."),
        (["calibrate", "smollm2-135m", "--out", out, "--group-size", "128"],
         "group_size=128 does not divide head_dim=64; choose a group size that divides it (e.g. 64)."),
        (["calibrate", "smollm2-135m", "--out", out, "--clip-grid-v", "0,1.5"],
         "clip grid (0.0, 1.5) must be a non-empty list of ratios <= 1 (0 = no clip)."),
        (["calibrate", "smollm2-135m", "--out", out, "--max-bits", "-1"], "max_bits=-1.0 must be >= 0 (0 = pure INT2)."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--context", "9000"],
         "context 9000 exceeds the model's maximum of 8192 positions; pass --context 8192 or less."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--clip-k", "1.2"],
         "clip_ratio_k=1.2 must be <= 1 (use 0 to disable clipping)."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--lengths", "2048,9000"],
         "context 9010 exceeds the model's maximum of 8192 positions; use --lengths of at most 8182 (the answer takes "
         "10 tokens more)."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--lengths", ","], "--lengths is empty; give at least one value."),
        (["eval", "niah", "smollm2-135m", "--methods", "bf16", "--trials", "0"], "--trials 0: must be at least 1."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16", "--max-tokens", "0"], "--max-tokens 0: must be at least 1."),
        (["demo", "--max-tokens", "-5", "--out", str(tmp_path / "demo")], "--max-tokens -5: must be at least 1."),
        (["serve", "smollm2-135m", "--method", "bf16", "--kv-memory", "-2"], "--kv-memory -2.0: must be more than 0."),
        (["eval", "code", "smollm2-135m", "--methods", "bf16", "--group-size", "256"],
         "group_size=256 does not divide head_dim=64; choose a group size that divides it (e.g. 64)."),
        (["eval", "ppl", "smollm2-135m", "--methods", "bf16,oscar", "--rotations", tiny], mismatch),
        (["eval", "ppl", "random:qwen3-4b", "--methods", "bf16", "--group-size", "256"],
         "group_size=256 does not divide head_dim=128; choose a group size that divides it (e.g. 64)."),
        (["serve", "smollm2-135m", "--method", "bf16", "--max-context", "9000", "--port", "0"],
         "--max-context 9000 is longer than the model's 8192 positions."),
        (["serve", "smollm2-135m", "--method", "oscar", "--rotations", tiny, "--port", "0"], mismatch),
        (["serve", "smollm2-135m", "--method", "bf16", "--port", "99999"],
         "--port 99999: a TCP port is a number from 0 to 65535."),
        (["serve", "smollm2-135m", "--method", "bf16", "--port", str(held_port)],
         f"cannot listen on 127.0.0.1:{held_port} (Address already in use); pass another --port (or --host), or stop "
         "what holds it."),
        (["serve", "smollm2-135m", "--method", "oscar-paper"],
         "method 'oscar-paper' needs a rotations artifact: pass --rotations FILE, or serve --method bf16 (make one "
         "with `oscarkv calibrate MODEL --out FILE`)."),
    ]:
        capsys.readouterr()
        assert main(args) == 2, args
        assert capsys.readouterr().err.strip().splitlines() == ["oscarkv: error: " + line], args
    held.close()
    assert not (tmp_path / "rot.safetensors").exists()
    # The Python API's one-call form, likewise.
    import oscarkv

    with pytest.raises(ArtifactError) as raised:
        oscarkv.load("smollm2-135m", tiny)
    assert str(raised.value) == mismatch
    with pytest.raises(OscarError, match="method 'oscar' needs a rotations artifact"):
        oscarkv.load("smollm2-135m")

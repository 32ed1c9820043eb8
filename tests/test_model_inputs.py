"""Models that take other inputs than token ids, from the command line: `--inputs` specs and JSON files
(autoplan.models.inputs), Hugging Face encoder-decoders, Whisper and ViT with inputs from their configs, and
throughput in samples/s (tokens/s where a sequence exists)."""

import json

import pytest
import torch

import autoplan
from autoplan.cli.main import main
from autoplan.errors import UsageError
from autoplan.models.inputs import ModelInputs
from autoplan.models.loss import loss_kind, training_loss

pytest.importorskip("transformers")

T5 = dict(model_type="t5", architectures=["T5ForConditionalGeneration"], d_model=64, d_ff=128, d_kv=16, num_heads=4,
          num_layers=2, num_decoder_layers=2, vocab_size=256, dropout_rate=0.0, decoder_start_token_id=0,
          is_encoder_decoder=True)
VIT = dict(model_type="vit", architectures=["ViTForImageClassification"], hidden_size=64, num_hidden_layers=2,
           num_attention_heads=4, intermediate_size=128, image_size=32, patch_size=8, num_channels=3,
           id2label={str(i): f"c{i}" for i in range(10)})
WHISPER = dict(model_type="whisper", architectures=["WhisperForConditionalGeneration"], d_model=64,
               encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=32,
               max_target_positions=64, vocab_size=256, decoder_start_token_id=0, pad_token_id=0)


def hf(tmp_path, config: dict, **changes) -> str:
    folder = tmp_path / config["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return f"hf:{folder}"


def test_specs_and_json_files_read_the_same(tmp_path):
    spec = ModelInputs.parse("input_ids=int64[batch,seq]; pixel_values=float32[batch,3,32,32]")
    (tmp_path / "inputs.json").write_text(json.dumps({
        "input_ids": {"dtype": "int64", "shape": ["batch", "seq"]},
        "pixel_values": {"dtype": "float32", "shape": ["batch", 3, 32, 32]}}))
    assert ModelInputs.parse(str(tmp_path / "inputs.json")) == spec
    tensors = spec.at(2, 16, torch.bfloat16)
    assert tensors["input_ids"].shape == (2, 16) and tensors["input_ids"].dtype == torch.long
    assert tensors["pixel_values"].shape == (2, 3, 32, 32) and tensors["pixel_values"].dtype == torch.bfloat16
    assert spec.has_sequence and not ModelInputs.parse("x=float[batch,8]").has_sequence


@pytest.mark.parametrize("text, message", [
    ("input_ids=int64[seq]", "needs the dimension `batch` once"),
    ("input_ids=int8[batch,seq]", "dtype 'int8' is not one of"),
    ("input_ids=int64[batch,-3]", "dimension '-3' is not `batch`, `seq` or a positive size"),
    ("a=int64[batch] a=int64[batch]", "names an input twice: a"),
    ("input_ids int64 batch", "neither an inputs spec"),
    ("x=float[batch,seq,seq]", "names `seq` more than once"),
])
def test_bad_specs_say_what_is_wrong(text, message):
    with pytest.raises(UsageError, match=message):
        ModelInputs.parse(text)


def test_a_json_file_of_inputs_is_data(tmp_path):
    (tmp_path / "bad.json").write_text('{"input_ids": {"dtype": "int64", "shape": ["batch", "seq"], "code": 1}}')
    with pytest.raises(UsageError, match="dtype and shape only"):
        ModelInputs.parse(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(UsageError, match="must hold an object"):
        ModelInputs.parse(str(tmp_path / "list.json"))


def test_an_encoder_decoder_plans_from_the_cli_with_its_decoder_inputs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = hf(tmp_path, T5)
    assert main(["search", "--model", model, "--mem", "1GB", "--gpus", "2", "--seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "inputs: input_ids=int64[batch,seq] decoder_input_ids=int64[batch,seq]" in out and "tokens/s" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["model"]["inputs"] == "input_ids=int64[batch,seq] decoder_input_ids=int64[batch,seq]"
    # a shorter decoder, given; the plan file's estimate traces the same inputs
    assert main(["search", "--model", model, "--mem", "1GB", "--gpus", "2", "--seq-len", "64", "-o", "short.json",
                 "--inputs", "input_ids=int64[batch,seq] decoder_input_ids=int64[batch,16]"]) == 0
    short = autoplan.load_plan(tmp_path / "short.json")
    assert short.predicted.peak_mem_bytes < autoplan.load_plan(tmp_path / "plan.json").predicted.peak_mem_bytes
    assert autoplan.estimate(plan=tmp_path / "short.json").predicted == short.predicted


def test_vision_plans_in_samples_per_second_with_no_sequence(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    model = hf(tmp_path, VIT)
    assert main(["search", "--model", model, "--mem", "1GB", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "no sequence;" in out and "inputs: pixel_values=float32[batch,3,32,32]" in out
    throughput = next(line for line in out.splitlines() if "throughput" in line)
    assert "samples/s" in throughput and "tokens/s" not in throughput
    assert main(["search", "--model", model, "--mem", "1GB", "--gpus", "2", "--seq-len", "197"]) == 2
    assert "have no `seq` dimension" in capsys.readouterr().err


def test_whisper_takes_its_log_mel_features(tmp_path):
    plan = autoplan.search(hf(tmp_path, WHISPER), "1GB", gpus=2, seq_len=32)
    assert plan.model.inputs == "input_features=float32[batch,16,64] decoder_input_ids=int64[batch,seq]"
    with pytest.raises(UsageError, match="`seq_len` 100 is longer than the 64 positions"):
        autoplan.search(hf(tmp_path, WHISPER), "1GB", gpus=2, seq_len=100)


def test_the_loss_of_each_kind_of_output():
    class Output(dict):
        def __getattr__(self, name):
            return self[name] if name in self else None

        def to_tuple(self):
            return tuple(self.values())

    logits = torch.randn(2, 8, 16, requires_grad=True)
    classes = Output(logits=torch.randn(2, 10))
    hidden = Output(last_hidden_state=torch.randn(2, 8, 4))
    assert [loss_kind(o) for o in (logits, classes, hidden)] == ["next-token", "classes", "mean"]
    assert training_loss(hidden) == pytest.approx(hidden["last_hidden_state"].mean().item())
    assert training_loss(classes).item() == pytest.approx(
        torch.nn.functional.cross_entropy(classes["logits"], torch.zeros(2, dtype=torch.long)).item())

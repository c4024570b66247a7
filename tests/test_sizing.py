"""Conversations a decode replica keeps at a context length (bidirkv/sizing.py)."""

import json

import pytest

from bidirkv.cli import main
from bidirkv.sizing import GIB, KNOWN, Hardware, ModelShape, shape_of_config, size


def test_the_example_resource_at_32k_and_128k():
    # Qwen3-32B: 64 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 256 KiB a token.
    qwen = KNOWN["Qwen/Qwen3-32B"]
    assert qwen.kv_bytes_per_token(2) == 256 * 1024
    s = size(qwen, Hardware(gpus=8), 2, 2, 0.9, [32_768, 131_072])
    # 8 x (140 GiB x 0.9 - 32.8e9 x 2 / 8 bytes of weights - 6 GiB) / 256 KiB.
    kv = 8 * (140 * GIB * 0.9 - 32.8e9 * 2 / 8 - 6 * GIB)
    assert s.kv_capacity_tokens == int(kv // (256 * 1024))
    assert s.rows == [(32_768, 112, 101), (131_072, 28, 25)]


def test_fp8_kv_doubles_what_is_kept_and_a_lower_watermark_keeps_less():
    qwen = KNOWN["Qwen/Qwen3-32B"]
    bf16 = size(qwen, Hardware(8), 2, 2, 0.9, [131_072]).rows[0][2]
    fp8 = size(qwen, Hardware(8), 2, 1, 0.9, [131_072]).rows[0][2]
    half = size(qwen, Hardware(8), 2, 2, 0.5, [131_072]).rows[0][2]
    assert fp8 in (2 * bf16, 2 * bf16 + 1) and half < bf16


def test_a_shape_from_a_config_and_what_it_lacks():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "hidden_size": 512}
    assert shape_of_config(cfg, 0.02) == ModelShape(4, 4, 64, 0.02)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shape_of_config({"hidden_size": 512}, 1.0)


def test_no_room_for_kv_is_an_error_naming_the_figures():
    with pytest.raises(ValueError, match="nothing is left for KV"):
        size(KNOWN["meta-llama/Llama-3.1-70B-Instruct"], Hardware(1, 80.0), 2, 2, 0.9,
             [1024])


def test_the_command_prints_the_table_and_refuses_bad_input(capsys, tmp_path):
    assert main(["sizing", "-f", "examples/inference.yaml"]) == 0
    out = capsys.readouterr().out
    assert "| 131,072 | 32.0 GiB | 28 | 25 |" in out and "maxModelLen" in out
    other = tmp_path / "other.yaml"
    other.write_text("spec: {model: {name: acme/unknown}}\n")
    assert main(["sizing", "-f", str(other)]) == 2
    assert "--model-config" in capsys.readouterr().err
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "head_dim": 128}))
    assert main(["sizing", "-f", str(other), "--model-config", str(config)]) == 2
    assert "--params-b" in capsys.readouterr().err
    assert main(["sizing", "-f", str(other), "--model-config", str(config),
                 "--params-b", "8", "--context", "8192"]) == 0
    assert "| 8,192 |" in capsys.readouterr().out
    assert main(["sizing", "-f", "examples/inference.yaml", "--context", "-5"]) == 2
    assert "--context -5" in capsys.readouterr().err

import json

import pytest

from autotune.vocabulary.errors import ModelNotFound
from autotune.specs.models import resolve_model


def test_gpt2_family_resolves_offline_to_known_architectures():
    spec = resolve_model("gpt2")
    assert spec.source == "builtin"
    assert (spec.config["n_layer"], spec.config["n_embd"], spec.max_positions) == (12, 768, 1024)
    assert resolve_model("openai-community/gpt2-medium").config["n_layer"] == 24
    assert resolve_model("gpt2").fingerprint != resolve_model("distilgpt2").fingerprint


def test_local_directory_with_only_config(tiny_model):
    spec = resolve_model(tiny_model)
    assert spec.source == "local"
    assert spec.max_positions == 256
    assert spec.path is not None


def test_unknown_model_offline_names_what_to_pass():
    with pytest.raises(ModelNotFound, match="config.json"):
        resolve_model("someone/not-a-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json"):
        resolve_model(str(tmp_path))


def test_config_that_is_not_a_transformers_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hello": 1}))
    with pytest.raises(ModelNotFound, match="model_type"):
        resolve_model(str(tmp_path))

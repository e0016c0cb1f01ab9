"""Files that hold no model to run are named for what they are by the loader itself, so the app, the
server and the CLI all say the same (the CLI alone used to; the others said "re-convert it")."""

from __future__ import annotations

import pytest
from minecart.engine.errors import GGUFError
from minecart.engine.model import check_model_file
from minecart.engine.runtime import Runtime


def test_a_vocabulary_only_file_is_called_one(fixtures_dir):
    path = fixtures_dir / "qwen35-vocab.gguf"
    with pytest.raises(GGUFError, match="vocabulary-only GGUF"):
        check_model_file(path)
    with Runtime(sample_memory_s=0) as rt:
        final = rt.load(str(path), devices=["cpu:0"]).wait(60)
        assert final.kind == "error" and "vocabulary-only" in final.text
        assert "re-convert" not in final.text

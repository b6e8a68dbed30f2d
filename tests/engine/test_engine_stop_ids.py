"""Stop ids that only generation_config.json lists (Llama 3's <|eot_id|> style) reach the
engine's chat format, so every user of ``engine.chat_format.stop_token_ids`` stops on them."""

from __future__ import annotations

import transformers

from chatsvc.engine.config import EngineConfig
from chatsvc.engine.engine import LLMEngine
from chatsvc.engine.loader import load_model
from tests.engine.test_loader_local_dirs import SHAPE


def test_generation_config_eos_ids_are_chat_format_stop_ids(tmp_path, smollm2_fp32):
    config = transformers.LlamaConfig(**SHAPE, eos_token_id=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer = smollm2_fp32.tokenizer
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7, 9]}')
    loaded = load_model(str(tmp_path), dtype="fp32")
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_gpu_blocks=16), loaded=loaded)
    stop_ids = engine.chat_format.stop_token_ids
    assert {2, 7, 9} <= set(stop_ids)
    # The tokenizer's own eos and the template's end-of-turn token are kept, once each.
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in stop_ids
    assert len(stop_ids) == len(set(stop_ids))
    assert {7, 9} <= engine.default_stop_ids

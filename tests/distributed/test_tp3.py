"""Three ranks (the default model's 3 KV heads, one each): the all-reduce beyond two ranks, in its two forms.

A buffer of at least SUM_PARTS_MIN_BYTES (a prefill of 29 rows or more here) is summed in parts (an all-to-all,
then an all-gather); a smaller one (a decode step, a short chunk) is gathered whole. Both sum every element in
rank order, so greedy tokens equal TP=1's and a request's bits do not depend on which form its steps took:
alone its prompt is one big prefill, in the crowd it is cut into small chunks.
"""

from __future__ import annotations

import pytest
import torch

from pagoda.distributed.group import SUM_PARTS_MIN_BYTES
from tests.distributed.helpers import tp_model
from tests.distributed.test_tensor_parallel import LOGITS_ATOL, greedy, prompt_logits
from tests.model.test_batch_invariance import GREEDY, SAMPLED, check_invariance
from tests.model.test_hf_reference import PROMPTS

pytestmark = pytest.mark.slow


def test_tp3_matches_tp1_and_is_batch_invariant_across_both_forms(default_model_dir, default_tokenizer):
    from pagoda.model.loader import load_model

    whole, _ = load_model(default_model_dir, "float32", "cpu", max_positions=512)
    long_prompt = default_tokenizer.encode_chat([{"role": "user", "content": PROMPTS[2] + " " + PROMPTS[4]}])
    assert len(long_prompt) * whole.config.hidden_size * 4 >= SUM_PARTS_MIN_BYTES  # its prefill goes in parts
    with tp_model(default_model_dir, 3, max_model_len=512) as (model, ranks):
        assert model.shard.num_kv_heads == 1 and ranks.group.size == 3
        one, three = prompt_logits(whole, long_prompt), prompt_logits(model, long_prompt, ranks)
        assert torch.equal(one.argmax(-1), three.argmax(-1)) and (one - three).abs().max() < LOGITS_ATOL
        assert greedy(model, long_prompt, ranks) == greedy(whole, long_prompt)
        targets = [("greedy", long_prompt, GREEDY),
                   ("sampled", default_tokenizer.encode_chat([{"role": "user", "content": PROMPTS[0]}]), SAMPLED)]
        check_invariance(model, targets, tight_blocks=40, ranks=ranks)

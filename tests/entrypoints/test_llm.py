"""The offline API on the real default model: batching, preemption, prefix caching,
seeded sampling, stop strings; and a tiny sliding-window model against transformers
(the engine core runs in-process here)."""

from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "In 1969, astronauts",
    "My favourite recipe for pancakes",
    "Water boils at",
    "The quick brown fox",
    "To be or not to be,",
    "Machine learning is",
    "The largest planet in the solar system",
    "Here is a haiku about autumn:",
    "import numpy as np\n",
    "The meaning of life is",
    "Dear Sir or Madam,",
    "1, 2, 3, 4,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    llm = LLM(multiprocess_mode=False, max_num_seqs=32)
    yield llm
    llm.shutdown()


def _core(llm: LLM):
    return llm.llm_engine.engine_core.engine_core


def _texts(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_equals_one_at_a_time(llm: LLM) -> None:
    batched = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.prompt for o in batched] == PROMPTS
    single = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in PROMPTS]
    assert _texts(batched) == _texts(single)
    assert all(len(o.outputs[0].token_ids) == 24 for o in batched)


def test_preemption_keeps_results_and_frees_blocks(monkeypatch) -> None:
    """On the exact path (float32 activations) a preempted request's recomputed tokens
    give the numbers their first computation gave. (On the int8 path the recompute reads
    them as prompt rows, float32: its later tokens may differ, as in vLLM.)"""
    exact = LLM(multiprocess_mode=False, gguf_activations="float32")
    try:
        expected = _texts(exact.generate(PROMPTS[:8], GREEDY, use_tqdm=False))
    finally:
        exact.shutdown()
    monkeypatch.setenv("PAGELLM_CHECK_INVARIANTS", "1")
    # 8 prompts of ~6 tokens + 24 outputs need ~2 blocks each; 10 blocks force preemption.
    small = LLM(multiprocess_mode=False, num_gpu_blocks_override=10, block_size=8, max_num_seqs=8,
                max_model_len=72, gguf_activations="float32")
    try:
        core = _core(small)
        assert core.check_invariants
        got = small.generate(PROMPTS[:8], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        assert all(o.finished for o in got)
        # block_size 8 vs 16 changes nothing numerically.
        assert _texts(got) == expected
        assert core.scheduler.num_preemptions_total > 0
        pool = core.scheduler.kv_cache_manager.block_pool
        pool.check_invariants()
        assert pool.get_num_free_blocks() == pool.num_usable_blocks == 9  # block 0 is the null block
    finally:
        small.shutdown()


def test_whole_prompt_prefix_hit_gives_the_same_greedy_tokens(llm: LLM) -> None:
    """A prompt of 33 tokens is read again from its last token alone (2 full blocks of 16
    cached): that row is a prompt row, float32, as when the prompt was read whole, not an
    int8 decode row, so greedy tokens repeat exactly."""
    tok = llm.get_tokenizer()
    ids = tok.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 10),
                     add_special_tokens=False)[:33]
    llm.reset_prefix_cache()
    first = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_prefix_caching_hits_and_same_output(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prefix = tok.encode(" ".join(["alpha beta gamma delta"] * 30), add_special_tokens=False)[:64]
    a = {"prompt_token_ids": prefix + tok.encode(" first", add_special_tokens=False)}
    b = {"prompt_token_ids": prefix + tok.encode(" second question", add_special_tokens=False)}
    llm.reset_prefix_cache()
    first = llm.generate(a, GREEDY, use_tqdm=False)[0]
    second = llm.generate(b, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 48
    no_cache = LLM(multiprocess_mode=False, enable_prefix_caching=False)
    try:
        ref = no_cache.generate(b, GREEDY, use_tqdm=False)[0]
        assert ref.num_cached_tokens == 0
        assert ref.outputs[0].token_ids == second.outputs[0].token_ids
    finally:
        no_cache.shutdown()


def test_seeded_sampling_is_reproducible_across_batches(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPTS[0], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)
    mixed = llm.generate(PROMPTS[:5], [seeded if i == 2 else others for i in range(5)], use_tqdm=False)
    in_batch = llm.generate([PROMPTS[3], PROMPTS[0]], [others, seeded], use_tqdm=False)
    assert alone == again == in_batch[1].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids != [] and len(mixed) == 5


def test_n_outputs_and_top_k_one_is_greedy(llm: LLM) -> None:
    out = llm.generate(PROMPTS[1], SamplingParams(n=4, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(out) == 1
    assert [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 12 for c in out[0].outputs)
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    greedy = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    top1 = llm.generate(PROMPTS[1], SamplingParams(top_k=1, temperature=1.0, seed=3, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert top1[0].outputs[0].token_ids == greedy


def test_stop_string_across_token_boundary(llm: LLM) -> None:
    ref = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    # A stop string made of the end of one token and the start of the next.
    pieces = [tok.decode(ref.token_ids[: i + 1]) for i in range(len(ref.token_ids))]
    k = next(i for i in range(2, len(pieces)) if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i - 1]) - len(pieces[i - 2]) >= 2)
    boundary = len(pieces[k - 1])
    stop = pieces[k][boundary - 1 : boundary + 1]
    assert stop not in pieces[k - 1]
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    cut = ref.text.index(stop)
    assert out.text == ref.text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == ref.text[: cut + len(stop)]


def test_ignore_eos_gives_exactly_max_tokens(llm: LLM) -> None:
    out = llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [40, 40, 40]
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_chat_uses_the_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text


def test_bad_input_is_rejected_clearly(llm: LLM) -> None:
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate({"prompt_token_ids": [1] * 9000}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match="Unknown engine argument.*not_an_option"):
        LLM(not_an_option=1)
    with pytest.raises(ValueError, match=(
        r"The KV cache holds 72 tokens \(9 blocks of 8\), fewer than one sequence of max_model_len=73; "
        "lower max_model_len to at most 72")):
        LLM(multiprocess_mode=False, num_gpu_blocks_override=10, block_size=8, max_model_len=73)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="seed must be a signed 64-bit integer, got 1180591620717411303424"):
        SamplingParams(seed=2**70)
    # a template's own raise_exception (e.g. "roles must alternate") and a syntax error
    with pytest.raises(ValueError, match="chat template failed: TemplateError: roles must alternate"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False,
                 chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="chat template failed: TemplateSyntaxError"):
        llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False, chat_template="{% if %}")
    assert not llm.llm_engine.has_unfinished_requests()


def test_sliding_window_model_generates_as_transformers(tiny_model) -> None:
    """Through the whole engine (model runner -> attention builder): a Mistral with an
    8-token window, 30-token prompts, 20 greedy tokens each, two prompts batched; HF's
    greedy choice recomputed over the full sequence at every step is the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.utils import token_ids

    model_dir = tiny_model("mistral", sliding_window=8)
    prompts = [token_ids(30, offset) for offset in (13, 17)]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        seq = list(prompt)
        with torch.inference_mode():
            for _ in range(20):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        expected.append(seq[30:])
    llm = LLM(model_dir, multiprocess_mode=False, dtype="float32", max_model_len=128)
    try:
        assert llm.llm_engine.engine_core.engine_core.model_runner.attn_builder.sliding_window == 8
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    assert _texts(outputs) == expected

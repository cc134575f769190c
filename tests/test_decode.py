"""The rollout decode loop (trainer/model/decode.py): the tokens transformers' generate gives, each token's
log-prob from the logits it was drawn from, EOS bookkeeping on the device, and the sampling masks."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
import torch
from conftest import dense_copies_made
from test_shared_base import VOCAB, batch, perturbed_ppo_model, sft_adapter, tiny_args  # noqa: F401 (fixture)

from foundation.cli import UsageError
from profiling import components as C
from trainer.model.decode import CHECK_EVERY, Generator, Sampling, check_path, pick_tokens, truncated
from trainer.model.shared_base import AdapterSpec, build_shared_model


def hf_greedy(model, ids, mask, new_tokens, eos_id, pad_id, min_new_tokens=0):
    """transformers' own greedy generate under the policy: the reference the loop is held to."""
    with torch.no_grad(), model.use_adapter("policy"):
        model.eval()
        out = model.peft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=min_new_tokens, do_sample=False, eos_token_id=eos_id,
                                  pad_token_id=pad_id, use_cache=True)
    return out[:, ids.shape[1]:]


# The tests of inductor's own work on the compiled step (its graph passes); the others claim what dynamo traces and
# what the decoder does around it, and compile with the aot_eager backend (`traced_not_generated`).
INDUCTOR = ("test_the_compiled_step_multiplies_lora_b_without_a_matmul",
            "test_the_compiled_step_multiplies_each_sibling_group_s_one_matrix_once",
            "test_shared_products_computes_a_matmul_of_one_input_by_one_matrix_once")


@pytest.fixture(autouse=True)
def backend(request):
    if request.node.originalname not in INDUCTOR:
        request.getfixturevalue("traced_not_generated")


@pytest.fixture(scope="module")
def tiny():
    """A policy that changes the base, in eval mode (as a decode runs it): its scoring passes see no LoRA dropout,
    whichever test runs first."""
    torch.manual_seed(0)
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def compiled(tiny):
    """`tiny`'s compiled decoder, kept across the module's tests as a run keeps its one: its step compiles once
    per batch size."""
    return Generator(tiny, "compiled")


def greedy(new, min_new=0):
    return Sampling(max_new_tokens=new, min_new_tokens=min_new, temperature=0.0)


def decode(model, ids, mask, sampling, eos_id, pad_id, path="eager", weights="quantized"):
    """One decode by a decoder of its own: nothing kept from another call."""
    return Generator(model, path, weights).sample(ids, mask, sampling, eos_id, pad_id)


@pytest.mark.parametrize("rows", [1, 3, 64])
def test_greedy_tokens_equal_transformers_generate_with_left_padded_prompts(tiny, rows):
    ids, mask = batch(seed=rows, b=max(rows, 2), t=9)
    ids, mask = ids[:rows], mask[:rows]
    eos = int(hf_greedy(tiny, ids, mask, 6, eos_id=VOCAB + 1, pad_id=0)[0, 2])  # a token row 0 emits third
    want = hf_greedy(tiny, ids, mask, 12, eos_id=eos, pad_id=0)
    got = decode(tiny, ids, mask, greedy(12), eos_id=eos, pad_id=0)
    width = want.shape[1]  # generate stops at the step every row ended; the loop at most CHECK_EVERY - 1 later
    assert torch.equal(got.tokens[:, :width], want)
    assert (got.tokens[:, width:] == 0).all() and got.tokens.shape[1] <= max(width, CHECK_EVERY * -(-width // CHECK_EVERY))
    assert torch.equal(got.ended, (want == eos).any(1))
    assert bool(got.ended[0])


def test_every_row_ended_stops_the_loop_at_the_next_check_and_pads_after_eos(tiny):
    """Row 0 draws EOS at its first token: it is pad from there on; once every row has ended the loop stops
    at the next check, never running max_new_tokens steps."""
    ids, mask = batch(b=2, t=8)
    first = hf_greedy(tiny, ids, mask, 1, eos_id=VOCAB + 1, pad_id=0)[:, 0]
    eos = int(first[0])
    got = decode(tiny, ids, mask, greedy(40), eos_id=eos, pad_id=VOCAB - 1)
    assert got.tokens[0, 0] == eos and (got.tokens[0, 1:] == VOCAB - 1).all() and bool(got.ended[0])
    full = decode(tiny, ids[:1], mask[:1], greedy(40), eos_id=eos, pad_id=VOCAB - 1)
    assert full.tokens.shape[1] == CHECK_EVERY and bool(full.ended.all())



def test_before_min_new_tokens_the_loop_reads_nothing_from_the_device(tiny):
    """No row can end before min_new_tokens (EOS is barred): the loop does not ask whether every row has ended
    until then, one read of the device fewer per `CHECK_EVERY` steps than with no minimum (counted eager: the
    model's own reads are the same in both; a compiled step under the counting mode would not be compiled)."""
    from conftest import dispatch_counter

    ids, mask = batch(b=3, t=8)
    new = 3 * CHECK_EVERY
    host_reads = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def reads(min_new: int) -> int:
        sampling = Sampling(max_new_tokens=new, min_new_tokens=min_new, temperature=1.0)
        with dispatch_counter(lambda func: func in host_reads) as counted:
            decode(tiny, ids, mask, sampling, 1, 0)
        return counted.count

    assert reads(0) - reads(new) == (new - 1) // CHECK_EVERY == 2

@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_min_new_tokens_bars_eos_until_then_as_generate_does(tiny, path):
    """EOS barred for the first min_new_tokens, as transformers' generate bars it; a compiled decode compiles
    its step once for the steps on both sides of min_new_tokens (the bar is a tensor, not a guarded flag)."""
    from torch._dynamo.utils import counters

    ids, mask = batch(b=3, t=7)
    eos = int(hf_greedy(tiny, ids, mask, 1, eos_id=VOCAB + 1, pad_id=0)[0, 0])  # row 0's first greedy token
    want = hf_greedy(tiny, ids, mask, 6, eos_id=eos, pad_id=0, min_new_tokens=4)
    compiled_before = counters["stats"]["unique_graphs"]
    got = decode(tiny, ids, mask, greedy(6, min_new=4), eos_id=eos, pad_id=0, path=path)
    assert counters["stats"]["unique_graphs"] - compiled_before == (path == "compiled")
    assert torch.equal(got.tokens[:, :want.shape[1]], want)
    assert (got.tokens[:, :4] != eos).all()


def test_each_token_s_log_prob_and_entropy_come_from_the_logits_it_was_drawn_from(tiny):
    """Sampled at T 0.7 with top-k: every log-prob and entropy is the full softmax's at T 0.7 of the logits the
    model gave at that step (a policy pass over prompt + response), and every token is in that step's top k."""
    ids, mask = batch(b=4, t=8)
    sampling = Sampling(max_new_tokens=10, min_new_tokens=10, temperature=0.7, top_k=5)
    torch.manual_seed(3)
    got = decode(tiny, ids, mask, sampling, eos_id=VOCAB - 1, pad_id=0)  # EOS barred throughout
    full = torch.cat([ids, got.tokens], 1)
    with torch.no_grad():
        logits = tiny.logits(full, torch.cat([mask, torch.ones_like(got.tokens)], 1), "policy")
    step_logits = logits[:, ids.shape[1] - 1:-1].float() / 0.7
    logp = step_logits.log_softmax(-1)
    torch.testing.assert_close(got.logprobs, logp.gather(-1, got.tokens[..., None])[..., 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.entropy, -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)
    step_logits[..., VOCAB - 1] = float("-inf")
    top5 = step_logits.topk(5, dim=-1).indices
    assert (top5 == got.tokens[..., None]).any(-1).all()


def test_top_k_and_top_p_keep_what_transformers_warpers_keep():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    scores = torch.randn(6, 50) * 3
    for k, p in ((0, 0.9), (5, 1.0), (7, 0.5), (0, 0.05), (60, 0.99)):
        want = scores.clone()
        if k:
            want = TopKLogitsWarper(k)(None, want)
        if p < 1:
            want = TopPLogitsWarper(p)(None, want)
        assert torch.equal(truncated(scores.clone(), k, p), want), (k, p)


def test_draws_follow_the_truncated_distribution_and_greedy_takes_the_argmax():
    """Exponential races draw each token with its softmax probability (here 20,000 draws of 4 tokens)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -30.0]]).repeat(20000, 1)
    torch.manual_seed(0)
    tokens, logprobs, entropy = pick_tokens(logits, Sampling(temperature=1.0, top_k=4), eos_id=4, bar_eos=False)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    torch.testing.assert_close(freq[:4], logits[0, :4].softmax(-1), atol=0.01, rtol=0)
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[torch.arange(20000), tokens])  # untruncated
    assert freq[4] == 0
    tokens, _, _ = pick_tokens(logits[:2], Sampling(temperature=0.0), eos_id=0, bar_eos=True)
    assert tokens.tolist() == [1, 1]  # EOS (0 here) barred: the next best


def test_draws_at_a_temperature_follow_the_softmax_of_the_logits_over_it_once():
    """At T 0.7 (no top-k / top-p) 40,000 draws have frequencies softmax(z / 0.7) to 0.01 - dividing twice,
    softmax(z / 0.49), is 0.11 off on the first token - and each stored log-prob and entropy is
    log_softmax(z / 0.7)'s."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(40000, 1)
    torch.manual_seed(0)
    tokens, logprobs, entropy = pick_tokens(logits, Sampling(temperature=0.7), eos_id=3, bar_eos=False)
    freq = torch.bincount(tokens, minlength=4).float() / tokens.numel()
    want = (logits[0] / 0.7).log_softmax(-1)
    assert (freq - want.exp()).abs().max() < 0.01, (freq, want.exp())
    torch.testing.assert_close(logprobs, want[tokens])
    torch.testing.assert_close(entropy, -(want.exp() * want).sum().expand(40000))


def test_a_decode_path_outside_the_loop_s_is_refused_by_name():
    assert check_path("compiled") == "compiled"
    assert check_path("auto", "cuda") == "compiled" and check_path("auto", "cpu") == check_path("auto", "cuda", True) == "eager"
    with pytest.raises(UsageError, match="--decode 'static': must be one of auto, eager, compiled"):
        check_path("static")


def test_the_compiled_step_decodes_the_eager_tokens_and_log_probs_and_keeps_its_cache(tiny, compiled):
    """--decode compiled: a full-length static KV cache and a torch.compile'd step (CUDA graphs on CUDA), kept
    by the decoder for the next rollout; the eager loop's tokens and log-probs."""
    ids, mask = batch(b=2, t=8)
    eager = decode(tiny, ids, mask, greedy(6), eos_id=VOCAB + 1, pad_id=0)
    got = compiled.sample(ids, mask, greedy(6), eos_id=VOCAB + 1, pad_id=0)
    assert torch.equal(got.tokens, eager.tokens)
    torch.testing.assert_close(got.logprobs, eager.logprobs, rtol=1e-4, atol=1e-4)
    length, cache = compiled.compiled.caches[2]
    again = compiled.sample(ids[:, 2:], mask[:, 2:], greedy(6), eos_id=VOCAB + 1, pad_id=0)
    assert compiled.compiled.caches[2][1] is cache and length == 128  # 8 + 6 positions, rounded up
    # the bytes it keeps are the estimator's (profiling.activations.compiled_kv_cache)
    from profiling import activations as A
    from profiling.predict import EstimateArguments, forward_spec
    from profiling.shapes import load_shape

    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    spec = forward_spec(EstimateArguments(quantization="none", dtype="float32", device="cpu"), 4)
    assert held == A.compiled_kv_cache(load_shape("tiny-llama", VOCAB), spec, 2, 8 + 6)
    assert torch.equal(again.tokens, decode(tiny, ids[:, 2:], mask[:, 2:], greedy(6), VOCAB + 1, 0).tokens)


def test_the_compiled_step_compiles_its_decoder_layers_as_one_reused_region(tiny, compiled):
    """The compiled step marks every decoder layer's forward as one nested compile region (compiled once,
    stamped out for the others); the mark is a no-op outside a compile (the eager and training passes) and
    comes off where the step compiles whole (which decodes the eager tokens: `test_decoder_layer_regions_that_
    do_not_compile_fall_back_to_the_whole_step`). A layer whose forward is replaced already (--compile_layers)
    keeps it."""
    ids, mask = batch(b=2, t=8)
    compiled.sample(ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)
    layers = list(tiny.causal_lm.model.layers)
    assert compiled.compiled.regions.count == len(layers) == 2
    assert all("forward" in vars(layer) for layer in layers)
    torch.manual_seed(0)  # a model of its own, marked and unmarked here, so the module's decoder keeps its step
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    layers = list(model.causal_lm.model.layers)
    unmarked = decode(model, ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)
    generator = Generator(model, "compiled")
    generator.compile_anew()
    assert generator.compiled.regions.count == 2 and all("forward" in vars(layer) for layer in layers)
    marked = decode(model, ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)  # through the marked forwards
    assert torch.equal(marked.tokens, unmarked.tokens) and torch.equal(marked.logprobs, unmarked.logprobs)
    generator.compile_anew(regions=False)
    assert all("forward" not in vars(layer) for layer in layers) and generator.compiled.regions.count == 0
    own = layers[0].forward = lambda *a, **k: None  # as --compile_layers replaces it
    generator.compile_anew()
    assert generator.compiled.regions.count == 1 and layers[0].forward is own


def test_a_memory_record_counts_the_caches_the_compiled_step_keeps_as_kv_cache(tiny, compiled):
    """The compiled step keeps one full-length cache per batch size between rollouts: a memory record the
    decoder reports to counts its keys and values as kv_cache (in every phase, as the estimator does), none
    before it exists."""
    from profiling import components as C
    from profiling.recorder import MemoryRecorder

    recorder = MemoryRecorder("ppo", model=tiny)
    Generator(tiny, "compiled", recorder=recorder)  # no decode yet: no cache

    def kv_bytes():
        return recorder.count().components().get(C.KV_CACHE, 0)

    assert kv_bytes() == 0
    recorder.track(holder=compiled)
    ids, mask = batch(b=2, t=8)
    compiled.sample(ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)  # the module's decoder: its caches so far
    config = tiny.causal_lm.config
    assert 2 in compiled.compiled.caches
    positions = sum(rows * length for rows, (length, _) in compiled.compiled.caches.items())
    head_dim = config.hidden_size // config.num_attention_heads
    size = next(tiny.causal_lm.parameters()).element_size()
    assert kv_bytes() == config.num_hidden_layers * 2 * positions * config.num_key_value_heads * head_dim * size > 0


def test_fewer_rows_than_a_compiled_batch_decode_in_its_graph_and_cache(tiny, compiled):
    """--decode compiled with fewer rows than a batch size it has compiled for (a rollout's last chunk, an
    evaluation's last batch): the rows ride in that batch's graph and KV cache (no new compilation, no second
    cache the estimate does not price), the added rows start as ended, and the tokens are the eager loop's."""
    ids, mask = batch(b=2, t=8)  # the batch size the module's decoder compiled for (compiled here if run alone)
    compiled.sample(ids, mask, greedy(5), eos_id=VOCAB + 1, pad_id=0)
    kept = dict(compiled.compiled.caches)
    got = compiled.sample(ids[1:], mask[1:], greedy(5), eos_id=VOCAB + 1, pad_id=0)
    assert compiled.compiled.caches.keys() == kept.keys() and 2 in kept and 1 not in kept
    want = decode(tiny, ids[1:], mask[1:], greedy(5), eos_id=VOCAB + 1, pad_id=0)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.ended, want.ended)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)
    assert got.tokens.shape == (1, 5) and got.logprobs.shape == got.entropy.shape == (1, 5)


def test_the_compiled_step_traces_one_decoder_layer_and_stamps_it_out_for_the_others(monkeypatch):
    """Each decoder layer's region takes tensors only - its static cache's keys, values and count among them,
    which the decode's attention writes the step into (`decode_kv`) - so torch traces one layer and reuses the
    trace for the rest, where a cache object among the inputs has it trace every layer (transformers' own
    attention, which updates the cache itself) or a keyword the region would not pass on (each layer then keeps
    its own forward). The same tokens, log-probs and cache contents either way."""
    from contextlib import nullcontext

    from torch._dynamo.utils import compilation_time_metrics as timers

    from trainer.model import decode as module

    pytest.importorskip("torch._dynamo.variables.invoke_subgraph")  # a torch that reuses traced regions
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)  # 2 layers
    ids, mask = batch(b=3, t=7)

    def run():
        traced = len(timers.get("invoke_subgraph_trace", []))
        generator = Generator(model, "compiled")
        out = generator.sample(ids, mask, greedy(5, min_new=5), eos_id=1, pad_id=0)
        (_, cache), = generator.compiled.caches.values()
        kept = [(layer.keys.clone(), layer.values.clone(), int(layer.cumulative_length)) for layer in cache.layers]
        return out, len(timers.get("invoke_subgraph_trace", [])) - traced, kept

    def step_with_a_keyword(causal_lm, tokens, positions, cache_position, mask, cache, sampling, eos_id, bar_eos):
        logits = causal_lm(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                           cache_position=cache_position, use_cache=True, unknown_to_the_region=True).logits[:, -1]
        return module.pick_tokens(logits, sampling, eos_id, bar_eos)

    got, traced, cache = run()
    with monkeypatch.context() as patch:
        patch.setattr(module, "decode_attention", lambda causal_lm: nullcontext())
        want, traced_apart, cache_apart = run()
    with monkeypatch.context() as patch:  # a keyword the region would not pass on: each layer's own forward
        patch.setattr(module, "_step", step_with_a_keyword)
        keyword, traced_keyword, _ = run()
    assert (traced, traced_apart, traced_keyword) == (1, 2, 2)  # one trace, or one per layer
    assert torch.equal(keyword.tokens, want.tokens)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)
    for (keys, values, held), (want_keys, want_values, want_held) in zip(cache, cache_apart, strict=True):
        assert held == want_held == 7 + 4  # the prompt, then every step but the last one's token
        torch.testing.assert_close(keys, want_keys, rtol=0, atol=1e-6)
        torch.testing.assert_close(values, want_values, rtol=0, atol=1e-6)


def test_with_compile_layers_the_compiled_step_marks_the_no_grad_forward_of_each_compiled_layer():
    """--compile_layers replaces every decoder layer's forward; a compiled decode marks their no-grad forward
    (the one it runs) as the reused region and decodes the eager tokens; compiled whole, the mark comes off."""
    from trainer.model.compiled import CompiledLayer

    torch.manual_seed(0)
    model = build_shared_model(tiny_args(compile_layers=True), [AdapterSpec("policy", trainable=True)],
                               vocab_size=VOCAB)
    layers = list(model.causal_lm.model.layers)
    assert model.compiled_parts == len(layers) and all(isinstance(vars(x)["forward"], CompiledLayer) for x in layers)
    ids, mask = batch(b=2, t=8)
    eager = decode(model, ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)
    generator = Generator(model, "compiled")
    regions = generator.sample(ids, mask, greedy(4), eos_id=VOCAB + 1, pad_id=0)
    assert generator.compiled.regions.count == len(layers)
    assert all(vars(x)["forward"].eager == generator.compiled.regions.layer_step for x in layers)
    assert torch.equal(regions.tokens, eager.tokens)
    generator.compile_anew(regions=False)
    assert all(vars(x)["forward"].eager is type(x).forward for x in layers)


def test_each_step_compiled_anew_compiles_whatever_was_compiled_before_it(tiny, compiled):
    """Every compiled step (a decoder's, or one compiled anew) keeps its compiled frames apart from the others':
    sharing one list, the steps past dynamo's recompile limit would run eagerly, with one warning."""
    from torch._dynamo.utils import counters

    ids, mask = batch(b=2, t=8)
    compiled.sample(ids, mask, greedy(3), eos_id=VOCAB + 1, pad_id=0)  # a step compiled before (earlier tests')
    with torch._dynamo.config.patch(recompile_limit=1):
        compiled.compile_anew()
        before = counters["stats"]["unique_graphs"]
        compiled.sample(ids, mask, greedy(3), eos_id=VOCAB + 1, pad_id=0)
        assert counters["stats"]["unique_graphs"] > before


def test_a_checkpointed_model_decodes_compiled_in_one_graph(caplog):
    """Checkpointing hooks the input embeddings so that their output requires grad (every decoder layer then sees
    such an input: a compiled layer compiles one graph for all, tests/test_shared_base.py's
    `test_compiled_layers_give_the_eager_outputs_and_gradients_and_generate_eagerly`), in grad mode only:
    transformers' hook calls requires_grad_ in a no-grad decode too, where it breaks a compiled step's graph
    wherever dynamo cannot trace it (torch 2.11: three graphs a step). A step
    without breaks says nothing of them (`test_a_compiled_step_that_breaks_into_pieces_says_where_in_one_warning`)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = build_shared_model(tiny_args(checkpointing=True), [AdapterSpec("policy", trainable=True)],
                               vocab_size=VOCAB)
    assert model.causal_lm.is_activation_checkpointing
    ids, mask = batch(b=2, t=8)
    embeddings = model.causal_lm.get_input_embeddings()
    assert embeddings(ids).requires_grad and len(embeddings._forward_hooks) == 1
    with torch.no_grad():
        assert not embeddings(ids).requires_grad
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    with caplog.at_level(logging.INFO, logger="trainer.model.decode"):
        decode(model, ids, mask, greedy(3), eos_id=VOCAB + 1, pad_id=0, path="compiled")
    assert counters["stats"]["unique_graphs"] - graphs == 1
    assert sum(counters["graph_break"].values()) == breaks
    assert "decode compiled for 2 rows" in caplog.text and "graph break" not in caplog.text


def test_a_compiled_step_that_breaks_into_pieces_says_where_in_one_warning(caplog):
    """A graph break splits the compiled step into graphs that each token runs apart (on CUDA: CUDA graph replays
    with eager code between them): the first decode says so once, with the breaks' reasons."""
    import torch._dynamo

    torch._dynamo.reset()  # the frames around a break are the model classes', which earlier tests compiled
    torch.manual_seed(0)
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    generator = Generator(model, "compiled")  # without the break it says nothing: the checkpointed model's test
    model.causal_lm.model.norm.register_forward_hook(lambda *_: torch._dynamo.graph_break())
    for rows in (3, 3):  # the first decode at 3 rows compiles (and says so), the second replays
        ids, mask = batch(b=rows, t=8)
        with caplog.at_level(logging.WARNING, logger="trainer.model.decode"):
            generator.sample(ids, mask, greedy(3), eos_id=VOCAB + 1, pad_id=0)
    said = [r.message for r in caplog.records if "graph break" in r.message]
    assert len(said) == 1
    graphs = re.match(r"decode compiled for 3 rows: graph breaks split the step into (\d+) graphs, which each token "
                      r"runs apart \(", said[0])
    assert graphs and int(graphs[1]) >= 2  # the break's frame and the frames dynamo resumes around it
    assert "graph_break()" in said[0] and "\n" not in said[0]


def test_decoder_layer_regions_that_do_not_compile_fall_back_to_the_whole_step(monkeypatch, caplog):
    """Where the regions fail to compile (a torch without their support for a layer), the rollout compiles its
    step whole, says so in one line and decodes the same tokens; the layers' marks come off."""
    import torch._dynamo.exc

    def failing_region(forward):
        def marked(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("regions unsupported here")
        return marked

    torch.manual_seed(0)  # a model of its own: the module's decoder keeps its marks and its step
    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    ids, mask = batch(b=2, t=8)
    want = decode(model, ids, mask, greedy(5), eos_id=VOCAB + 1, pad_id=0)
    monkeypatch.setattr(torch.compiler, "nested_compile_region", failing_region)
    generator = Generator(model, "compiled")
    with caplog.at_level("WARNING", logger="trainer.model.decode"):
        got = generator.sample(ids, mask, greedy(5), eos_id=VOCAB + 1, pad_id=0)
    assert torch.equal(got.tokens, want.tokens) and generator.compiled.regions.count == 0
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)
    assert all("forward" not in vars(layer) for layer in model.causal_lm.model.layers)
    assert "did not compile as one reused region (TorchDynamoException: regions unsupported here)" in caplog.text


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_under_autocast_the_lora_products_multiply_copies_in_its_dtype_to_the_same_tokens(path, monkeypatch):
    """Under bf16 autocast (a run's mixed precision) a decode multiplies copies of the policy's LoRA weights
    in bf16, the values autocast would cast them to at every step: the same tokens and log-probs come out (to
    bf16's rounding where compiled: `test_the_compiled_step_multiplies_lora_b_without_a_matmul`). A
    compiled decode keeps its copies (its CUDA graphs read fixed addresses) and refreshes them in place when
    the weights change; an eager one frees them, and its LoRA layers run their own forward again after each
    decode, without a second compilation. Scoring passes never read them."""
    from contextlib import nullcontext

    from torch._dynamo.utils import counters

    from trainer.model.decode_weights import DecodeWeights

    torch.manual_seed(0)
    tiny = build_shared_model(tiny_args(dtype="bfloat16"), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in tiny.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    assert {p.dtype for p in tiny.trainable_parameters()} == {torch.float32}  # trained in fp32, multiplied in bf16
    ids, mask = batch(b=2, t=8)
    generator = Generator(tiny, path)

    def run(decoder=generator):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return decoder.sample(ids, mask, greedy(6), eos_id=VOCAB + 1, pad_id=0)

    layers = [layer for layer in tiny.lora_layers if "policy" in layer.lora_A]
    routed = [layer.forward for layer in layers]
    got = run()
    compiled_before = counters["stats"]["unique_graphs"]
    held = generator.held()[C.GENERATION_WEIGHTS]
    assert not any("decode_lora_copies" in vars(layer) for layer in layers)  # only while decoding
    assert [layer.forward for layer in layers] == routed
    if path == "eager":
        assert held == []
    else:
        assert len(held) == 2 * len(layers) and {t.dtype for t in held} == {torch.bfloat16}
        first = layers[0].lora_A["policy"].weight
        with torch.no_grad():
            first.add_(0.5)
        address = held[0].data_ptr()
        run()
        scaling = layers[0].scaling["policy"]  # LoRA-A copied scaled: no step scales its products
        assert held[0].data_ptr() == address and torch.equal(held[0], (first.detach() * scaling).to(torch.bfloat16))
        with torch.no_grad():
            first.sub_(0.5)
        got = run()
        assert counters["stats"]["unique_graphs"] == compiled_before  # the first decode's graph serves the others
    with monkeypatch.context() as patch:  # held to the eager loop without copies (no second compilation)
        patch.setattr(DecodeWeights, "lora_copies", lambda *args, **kwargs: nullcontext())
        want = run(Generator(tiny, "eager"))
    assert torch.equal(got.tokens, want.tokens)
    # compiled, the copies' LoRA-B product is a sum in fp32 rounded once, not a bf16 matmul: bf16's rounding
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=0 if path == "eager" else 2e-2)


def test_under_autocast_the_lora_a_copies_hold_the_scaling_so_no_step_multiplies_by_it(monkeypatch):
    """The copies a decode multiplies hold LoRA-A times the adapter's scaling: per LoRA layer and token one
    multiplication fewer than scaling the products, and, the scaling a power of two (alpha/r = 2 here), the
    same tokens and log-probs bit for bit."""
    from contextlib import nullcontext

    from conftest import dispatch_counter

    from trainer.model.decode_weights import DecodeWeights

    torch.manual_seed(0)
    tiny = build_shared_model(tiny_args(dtype="bfloat16"), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in tiny.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    layers = [layer for layer in tiny.lora_layers if "policy" in layer.lora_A]
    assert {layer.scaling["policy"] for layer in layers} == {2.0}
    ids, mask = batch(b=2, t=8)

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                dispatch_counter(lambda func: func._schema.name in ("aten::mul", "aten::mul_")) as counted:
            return decode(tiny, ids, mask, greedy(6), eos_id=VOCAB + 1, pad_id=0), counted.count

    got, multiplications = run()
    with monkeypatch.context() as patch:
        patch.setattr(DecodeWeights, "lora_copies", lambda *args, **kwargs: nullcontext())
        want, scaled_apart = run()
    # scaling the products at the prefill and 5 steps, against scaling each LoRA-A copy once per decode
    assert scaled_apart - multiplications == len(layers) * 6 - len(layers)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


def test_decoding_runs_the_policy_in_eval_mode_and_restores_train_mode(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(args, sft_dir)
    model.train()
    ids, mask = batch(t=6)
    with model.use_adapter("value"):
        out = decode(model, ids, mask, greedy(4, min_new=4), eos_id=1, pad_id=0)
        assert model.active_adapter == "value"
    assert out.tokens.shape == (2, 4)
    assert model.training
    if args.quantization == "none":
        assert torch.equal(out.tokens, hf_greedy(model, ids, mask, 4, 1, 0, min_new_tokens=4))


def test_the_pick_holds_the_four_fp32_buffers_the_estimator_prices():
    """Beside one step's logits, the pick holds four (rows x V) fp32 buffers at its peak whatever the sampling
    (what `profiling.predict` prices for the generate phase); top-p sorts and adds three."""
    from profiling.recorder import MemoryRecorder

    rows, vocab = 4, 32000
    logits = torch.randn(rows, vocab).to(torch.bfloat16)
    buffer = rows * vocab * 4
    for sampling, buffers in ((Sampling(temperature=0.7, top_k=50), 4), (Sampling(temperature=0), 4),
                              (Sampling(temperature=1.0, top_p=0.9), 7)):
        recorder = MemoryRecorder("ppo", vocab_size=vocab)
        with recorder.phase("generate"):
            pick_tokens(logits, sampling, eos_id=2, bar_eos=True)
        peak = recorder.records[("ppo", "generate")].live.peak
        assert buffers * buffer <= peak < buffers * buffer + 4096, sampling


# ---- generation weights: a dense copy of the 4-bit layers -----------------------------------------


@pytest.fixture(scope="module")
def tiny_nf4():
    torch.manual_seed(0)
    model = build_shared_model(tiny_args("nf4"), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def four_bit_layers(model):
    from bitsandbytes.nn import Linear4bit

    return [m for m in model.modules() if isinstance(m, Linear4bit)]


@pytest.mark.parametrize("weights", ["dequantized", "resident"])
def test_a_dense_copy_of_the_4bit_weights_decodes_the_same_tokens_and_log_probs(tiny_nf4, weights):
    """The copy holds what the 4-bit layers' forward multiplies by: the same tokens and log-probs as decoding
    from the 4-bit weights (rows > 1: bitsandbytes dequantizes for them too). After, the model holds its 4-bit
    layers again; `dequantized` frees the copy, `resident` keeps it for the next rollout."""
    ids, mask = batch(b=3, t=8)
    layers = four_bit_layers(tiny_nf4)
    sampling = Sampling(max_new_tokens=6, min_new_tokens=6, temperature=0.8)
    torch.manual_seed(5)
    want = decode(tiny_nf4, ids, mask, sampling, eos_id=1, pad_id=0)
    generator = Generator(tiny_nf4, "eager", weights)
    torch.manual_seed(5)
    got = generator.sample(ids, mask, sampling, 1, 0)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-6)
    assert four_bit_layers(tiny_nf4) == layers and generator.swapped_out() == []  # swapped back
    held = generator.held()[C.GENERATION_WEIGHTS]
    if weights == "resident":
        assert len(held) == len(layers)
        generator.sample(ids, mask, Sampling(max_new_tokens=2), 1, 0)
        assert [t.data_ptr() for t in generator.held()[C.GENERATION_WEIGHTS]] == [t.data_ptr() for t in held]  # once
        generator.release()
        assert generator.held()[C.GENERATION_WEIGHTS] == []
    else:
        assert held == []


def test_under_autocast_the_dense_copy_gives_the_lora_a_products_of_the_decoded_adapter_in_its_own_matmul(
        tiny_nf4, monkeypatch):
    """Under autocast in the copy's dtype (mixed precision, a GPU's default) each 4-bit base of a LoRA layer is
    copied with the decoded adapter's LoRA-A weights as extra rows: one matmul gives the base output and the
    LoRA-A products, one matmul per LoRA layer and token fewer. The same tokens and log-probs, to bf16
    rounding, as with a matmul of their own; after the decode no copy gives them any more."""
    from conftest import dispatch_counter

    import trainer.model.decode_weights as decode_module

    def matmuls():
        return dispatch_counter(lambda func: func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default))

    made = dense_copies_made(monkeypatch)
    ids, mask = batch(b=3, t=8)
    sampling = Sampling(max_new_tokens=6, min_new_tokens=6, temperature=0.8)

    def run():
        torch.manual_seed(5)
        with torch.autocast("cpu", dtype=torch.bfloat16), matmuls() as counted:
            return decode(tiny_nf4, ids, mask, sampling, 1, 0, weights="dequantized"), counted.count

    (fused, fused_matmuls), copies = run(), list(made)
    monkeypatch.setattr(decode_module, "_rows_for", lambda *a: 0)
    apart, apart_matmuls = run()
    lora_layers = len(tiny_nf4.lora_layers)
    assert sorted(c.lora_rank for c in copies) == [4] * lora_layers  # every base is a LoRA layer's, rank 4
    assert all(c.rows_for is None for c in copies)
    assert apart_matmuls - fused_matmuls == lora_layers * 6  # the prefill and 5 steps
    assert torch.equal(fused.tokens, apart.tokens)
    torch.testing.assert_close(fused.logprobs, apart.logprobs, rtol=0, atol=2e-2)


def test_the_compiled_step_multiplies_lora_b_without_a_matmul(monkeypatch):
    """Compiled, under autocast, a decode's LoRA-B products are rank-wide sums the compiler unrolls into the
    kernels that read them: the step's graphs hold no matmul over the rank (on a GPU a GEMM launched per LoRA
    layer and token), with the LoRA-A products from a copy of their own (`quantized`) or from the dense copy's
    rows (`dequantized`). The check sees those matmuls where the product is a matmul (eager's form; once, from
    the dense copy's rows). The same tokens, and log-probs to bf16's rounding."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    from trainer.model import decode_weights as module

    torch.manual_seed(0)
    model = build_shared_model(tiny_args("nf4"), [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    rank = 4  # tiny_args' lora_r: the base's and LoRA-A's matmuls sum over 64 or 172
    matmuls = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default")

    def over_the_rank(graph) -> int:  # each graph once: the step's, its decoder layers' region
        return sum(n.op == "call_function" and str(n.target) in matmuls and n.args[0].meta["val"].shape[-1] == rank
                   for n in graph.nodes)

    ids, mask = batch(b=3, t=8)
    sampling = Sampling(max_new_tokens=4, min_new_tokens=4, temperature=0.0)

    def run(weights):
        seen = []
        torch._dynamo.reset()  # compiled anew, its graphs through the pass below
        with inductor_config.patch(post_grad_custom_post_pass=lambda graph: seen.append(over_the_rank(graph))), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            return decode(model, ids, mask, sampling, 1, 0, path="compiled", weights=weights), sum(seen)

    summed = {weights: run(weights) for weights in ("quantized", "dequantized")}
    monkeypatch.setattr(module, "_times_lora_b", lambda products, b: torch.nn.functional.linear(products, b))
    matmul, matmul_matmuls = run("dequantized")
    layers = len(model.causal_lm.model.layers)  # compiled once, as one region: one layer's LoRA layers
    assert [count for _, count in summed.values()] == [0, 0]
    assert matmul_matmuls == len(model.lora_layers) // layers == 7
    for got, _ in summed.values():
        assert torch.equal(got.tokens, matmul.tokens)
        torch.testing.assert_close(got.logprobs, matmul.logprobs, rtol=0, atol=2e-2)


def test_the_recorder_counts_the_copy_as_generation_weights_at_the_estimator_s_size(tiny_nf4):
    """The dense copy is its own component in a memory record, and its bytes are the estimator's; while it
    stands in for the 4-bit layers, their weights still count as the base's."""
    from profiling import components as C
    from profiling.predict import generation_weight_bytes
    from profiling.recorder import MemoryRecorder
    from profiling.shapes import load_shape

    recorder = MemoryRecorder("ppo", model=tiny_nf4)
    per_rollout = Generator(tiny_nf4, "eager", "dequantized", recorder=recorder)
    resident = Generator(tiny_nf4, "eager", "resident", recorder=recorder)

    def components():
        return recorder.count().components()

    outside = components()
    with per_rollout.holding():
        inside = components()
    assert inside[C.GENERATION_WEIGHTS] > 0
    assert {c: inside[c] for c in outside} == outside
    assert components() == outside
    ids, mask = batch(b=2, t=6)
    resident.sample(ids, mask, Sampling(max_new_tokens=2), 1, 0)
    counted = components()[C.GENERATION_WEIGHTS]
    resident.release()
    assert counted == generation_weight_bytes(load_shape("tiny-llama", VOCAB), 2)  # bf16, the compute dtype
    assert C.GENERATION_WEIGHTS not in components()


def test_a_model_without_4bit_layers_decodes_as_it_is_with_a_dense_copy_asked(tiny, caplog):
    ids, mask = batch(b=2, t=6)
    generator = Generator(tiny, "eager", "dequantized")
    with caplog.at_level(logging.INFO, logger="trainer.model.decode_weights"):
        got = [generator.sample(ids, mask, greedy(4), VOCAB + 1, 0) for _ in range(2)]
    assert all(torch.equal(g.tokens, decode(tiny, ids, mask, greedy(4), VOCAB + 1, 0).tokens) for g in got)
    assert caplog.text.count("no 4-bit layer to dequantize") == 1  # said once


def test_a_rollout_makes_one_copy_and_records_it_as_generation_weights_in_generate(tiny_nf4, monkeypatch):
    """`dequantized` over a rollout of several chunks: one copy for the whole generate phase (not one per
    chunk), recorded as its own component there at the estimator's size, not inside the KV cache's transient;
    freed before the score phase."""
    from foundation.settings import RolloutArguments
    from profiling import components as C
    from profiling.predict import generation_weight_bytes
    from profiling.recorder import MemoryRecorder
    from profiling.shapes import load_shape
    from trainer.engine.phases import watching
    from trainer.rl.rewards import Scorer
    from trainer.rl.rollout import make_rollout

    made = dense_copies_made(monkeypatch)
    ids, mask = batch(b=4, t=6)
    args = RolloutArguments(max_new_tokens=3, min_new_tokens=3, rollout_micro_batch_size=2)
    recorder = MemoryRecorder("grpo", model=tiny_nf4)
    generator = Generator(tiny_nf4, "eager", "dequantized", recorder=recorder)
    with watching(recorder.phase):
        make_rollout(generator, ids, mask, args, Scorer(adapter=None), eos_id=1, pad_id=0, reference=False)
    assert len(made) == len(four_bit_layers(tiny_nf4))  # two chunks, one copy
    generate = recorder.records[("grpo", "generate")].components
    assert generate[C.GENERATION_WEIGHTS] == generation_weight_bytes(load_shape("tiny-llama", VOCAB), 2)
    assert C.GENERATION_WEIGHTS not in recorder.records[("grpo", "score")].components


def test_a_decode_step_from_the_dense_copy_reads_the_copy_in_place_of_the_4bit_weights(tiny_nf4):
    """The bandwidth bound of a step decoding from `dequantized` / `resident` weights counts the dense copy's
    bytes (the estimator's size) instead of the 4-bit weights and their constants; the rest is read alike."""
    from profiling import components as C
    from profiling.decode import bytes_per_decode_step
    from profiling.predict import generation_weight_bytes
    from profiling.shapes import load_shape

    quantized = bytes_per_decode_step(tiny_nf4)
    for weights in ("dequantized", "resident"):
        dense = bytes_per_decode_step(tiny_nf4, weights=weights)
        assert dense[C.GENERATION_WEIGHTS] == generation_weight_bytes(load_shape("tiny-llama", VOCAB), 2)
        assert "base_weights" not in dense and "base_quant_constants" not in dense
        assert {k: v for k, v in dense.items() if k != C.GENERATION_WEIGHTS} == {
            k: v for k, v in quantized.items() if not k.startswith("base_")}
    assert quantized["base_weights"] * 4 == dense[C.GENERATION_WEIGHTS]  # 4 bits a weight against 16


def test_a_per_rollout_copy_is_gone_when_the_rollout_ends(tiny_nf4, monkeypatch):
    """`dequantized`: nothing holds the dense copy once decoding is done (on CUDA its blocks then go back to
    the device: tests/test_gpu.py), while `resident` keeps it."""
    import gc
    import weakref

    from trainer.model import decode_weights as decode_module

    copies = []

    class Watched(decode_module.DequantizedLinear):
        def __init__(self, *args):
            super().__init__(*args)
            copies.append(weakref.ref(self.weight))

    monkeypatch.setattr(decode_module, "DequantizedLinear", Watched)
    ids, mask = batch(b=2, t=6)
    decode(tiny_nf4, ids, mask, Sampling(max_new_tokens=2), 1, 0, weights="dequantized")
    gc.collect()
    assert copies and all(ref() is None for ref in copies)
    copies.clear()
    generator = Generator(tiny_nf4, "eager", "resident")
    generator.sample(ids, mask, Sampling(max_new_tokens=2), 1, 0)
    gc.collect()
    assert copies and all(ref() is not None for ref in copies)
    generator.release()
    gc.collect()
    assert all(ref() is None for ref in copies)


def test_a_compiled_step_counts_a_placing_of_the_dense_copies_only_where_no_earlier_decode_found_them():
    """CUDA graphs read fixed addresses: a per-rollout copy at new ones has the step's graphs recorded anew (said in
    the log, with that decode's time), one back where an earlier decode of as many rows found it replays theirs."""
    from types import SimpleNamespace
    from unittest import mock

    from trainer.model.decode import CompiledStep

    compiled = SimpleNamespace(placings={}, caches={})
    a, b = [torch.zeros(4), torch.zeros(2)], [torch.zeros(4), torch.zeros(2)]

    def placing(copies, rows=8, adapter="policy"):
        return CompiledStep.placing(compiled, copies, rows, adapter)

    assert [placing(a), placing(a), placing(b), placing(a), placing(b)] == [0, 0, 2, 0, 0]
    assert placing([torch.zeros(1)]) == 3 and placing(a, rows=16) == 0  # the first decode of 16 rows records anyway
    assert placing(a, adapter="reference") == 0 and placing(b, adapter="reference") == 2  # its own LoRA copies
    assert placing([], rows=1) == 0 == placing([], rows=1)  # decoding from the 4-bit weights: nothing to place
    config = SimpleNamespace(num_hidden_layers=1)  # a longer rollout: a new cache, so every graph is recorded anew
    compiled.caches[8] = (128, None)
    with mock.patch("transformers.StaticCache", lambda **kwargs: "cache"):
        assert CompiledStep.cache(compiled, SimpleNamespace(config=config), 8, 200) == (256, "cache")
    assert placing(b) == 0 and placing(a) == 2 and placing(a, rows=16) == 0


def test_single_token_attention_on_grouped_kv_heads_equals_transformers_sdpa_without_repeating_them():
    """One query token on a grouped-query layer: the query heads folded onto their KV heads give transformers'
    sdpa output (which repeats the KV heads) for a boolean and an additive mask shared by the heads, and
    none; a longer query goes to transformers' sdpa itself."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from trainer.model.attention import single_token_gqa

    torch.manual_seed(0)
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    key, value = torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    allowed = torch.rand(2, 1, 1, 11) > 0.3
    allowed[..., 0] = True
    additive = torch.zeros(2, 1, 1, 11).masked_fill(~allowed, torch.finfo(torch.float32).min)
    for mask in (allowed, additive, None):
        query = torch.randn(2, 6, 1, 8)
        got, _ = single_token_gqa(module, query, key, value, mask, scaling=0.3)
        want, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
        assert got.shape == want.shape == (2, 1, 6, 8)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    query = torch.randn(2, 6, 11, 8)
    torch.testing.assert_close(single_token_gqa(module, query, key, value, None, scaling=0.3)[0],
                               sdpa_attention_forward(module, query, key, value, None, scaling=0.3)[0])


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_decoding_a_grouped_query_model_folds_each_step_s_heads_and_decodes_the_same(tiny, path, monkeypatch):
    """tiny-llama has 4 query heads on 2 KV heads: every decode step of every layer runs the folded attention,
    the model is back on sdpa after, and the greedy tokens and their log-probs are those of transformers' sdpa."""
    from contextlib import nullcontext

    from trainer.model import attention, decode as module

    config = tiny.causal_lm.config
    assert config.num_key_value_heads < config.num_attention_heads and config._attn_implementation == "sdpa"
    calls = []
    original = attention.single_token_gqa

    # run as the step is traced, with no guard on `calls`: one on its length would recompile the step every token
    @torch.compiler.assume_constant_result
    def noted(width: int) -> bool:
        calls.append(width)
        return True

    def counted(mod, query, *args, **kwargs):
        noted(query.shape[2])
        return original(mod, query, *args, **kwargs)

    delegated = []
    sdpa = attention._sdpa()
    monkeypatch.setattr(attention, "_sdpa", lambda: lambda mod, query, *a, **k: delegated.append(query.shape[2])
                        or sdpa(mod, query, *a, **k))
    monkeypatch.setattr(attention, "single_token_gqa", counted)
    assert attention._registered()  # registered first: the patch below then restores the real entry after
    monkeypatch.setitem(__import__("transformers").AttentionInterface._global_mapping, attention.DECODE_ATTENTION,
                        counted)
    ids, mask = batch(b=3, t=7)
    sampling = greedy(5, min_new=5)  # greedy: a compiled step draws other random numbers than the eager loop
    got = decode(tiny, ids, mask, sampling, eos_id=1, pad_id=0, path=path)
    assert config._attn_implementation == "sdpa"
    layers = config.num_hidden_layers
    assert calls[:layers] == [7] * layers and set(calls[layers:]) == {1}  # prefill, then one token a step
    assert delegated == [7] * layers  # only the prefill goes to transformers' sdpa
    if path == "eager":
        assert len(calls) == layers * 5
    with monkeypatch.context() as patch:  # transformers' sdpa, in the eager loop
        patch.setattr(module, "decode_attention", lambda causal_lm: nullcontext())
        want = decode(tiny, ids, mask, greedy(5, min_new=5), eos_id=1, pad_id=0)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-5)


def test_the_compiled_step_multiplies_each_sibling_group_s_one_matrix_once(monkeypatch):
    """Compiled from the dense copy under autocast, q/k/v and gate/up are one matmul each: four per decoder layer
    where each layer's own matmul made seven, with the same tokens and log-probs. Eager, each layer multiplies
    only its own rows: the same matmuls, of the same sizes, as without the groups. On one Qwen2 layer (each layer
    alike) at tiny-llama's sizes: a group with biases (q/k/v) and one without (gate/up, as all of Llama's)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer.model import decode as module, decode_weights

    overrides = ("num_hidden_layers=1,hidden_size=64,intermediate_size=172,num_attention_heads=4,num_key_value_heads=2,"
                 "vocab_size=512")
    torch.manual_seed(0)
    model = build_shared_model(replace(tiny_args("nf4"), model_name_or_path="qwen2.5-7b", preset_overrides=overrides),
                               [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.3)
    layers = model.causal_lm.config.num_hidden_layers
    for layer in model.causal_lm.model.layers:
        assert layer.self_attn.q_proj.base_layer.bias is not None and layer.mlp.gate_proj.base_layer.bias is None
    ids, mask = batch(b=3, t=8)
    matmuls = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default")

    def compiled():
        seen = []
        torch._dynamo.reset()
        generator = Generator(model, "compiled", "dequantized")
        generator.compile_anew(regions=False)  # every layer in the step's one graph
        sampling = Sampling(max_new_tokens=5, min_new_tokens=5, temperature=0.0)
        count = lambda graph: seen.append(sum(n.op == "call_function" and str(n.target) in matmuls
                                              for n in graph.nodes))
        with inductor_config.patch(post_grad_custom_post_pass=count), torch.autocast("cpu", dtype=torch.bfloat16):
            return generator.sample(ids, mask, sampling, 1, 0), sum(seen)

    class Sizes(TorchDispatchMode):  # each matmul's (rows, columns) of the matrix it multiplies by
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                self.seen.append(tuple(args[-1].shape))
            return func(*args, **(kwargs or {}))

    def eager():
        sampling = Sampling(max_new_tokens=3, min_new_tokens=3, temperature=0.0)
        with torch.autocast("cpu", dtype=torch.bfloat16), Sizes() as sizes:
            sizes.seen = []
            decode(model, ids, mask, sampling, 1, 0, weights="dequantized")
        return sorted(sizes.seen)

    grouped, grouped_matmuls = compiled()
    grouped_sizes = eager()
    monkeypatch.setattr(decode_weights, "SHARED_INPUT", ())
    apart, apart_matmuls = compiled()
    assert grouped_matmuls == 4 * layers + 1 and apart_matmuls == 7 * layers + 1  # + the LM head
    assert torch.equal(grouped.tokens, apart.tokens)
    torch.testing.assert_close(grouped.logprobs, apart.logprobs, rtol=0, atol=1e-6)
    assert grouped_sizes == eager()


def test_shared_products_computes_a_matmul_of_one_input_by_one_matrix_once():
    """The pass merges matmuls of the same input by the same matrix, also through views and casts, and leaves
    those of another input or matrix: what comes out is what eager computes."""
    import torch._inductor.config as inductor_config
    import torch.nn.functional as F

    from trainer.model.decode_weights import SharedProducts

    def step(x, y, w, v, bias):
        first = F.linear(x.to(torch.float32), w, bias)[..., :3]
        second = F.linear(x.to(torch.float32), w, bias)[..., 3:]  # the same product: merged
        other_input = F.linear(y, w, bias)
        other_matrix = F.linear(x.to(torch.float32), v)
        return first.sum(-1) + second.sum(-1) + other_input.sum(-1) + other_matrix.sum(-1)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g)
    w, v, bias = torch.randn(6, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(6, generator=g)
    seen = []
    count = lambda graph: seen.append(sum(n.op == "call_function" and "mm" in str(n.target) for n in graph.nodes))
    torch._dynamo.reset()
    with inductor_config.patch(post_grad_custom_post_pass=count):
        got = torch.compile(step, options={"post_grad_custom_pre_pass": SharedProducts()})(x, y, w, v, bias)
    assert seen == [3]
    torch.testing.assert_close(got, step(x, y, w, v, bias))

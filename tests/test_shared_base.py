"""The shared-base model: four adapters on one frozen base, switched safely and cheaply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import adapter_state, base_only, saved_head

from foundation.cli import UsageError
from foundation.settings import ModelArguments
from trainer.model.adapter_fit import HEAD_FILE
from trainer.model.outputs import position_ids_from_mask
from trainer.model.shared_base import AdapterSpec, build_shared_model

VOCAB = 512


def tiny_args(quantization="none", checkpointing=False, **kw) -> ModelArguments:
    return ModelArguments(model_name_or_path="tiny-llama", quantization=quantization,
                          gradient_checkpointing=checkpointing, lora_r=4, lora_alpha=8, **kw)


def batch(seed=0, b=2, t=10):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # one left-padded row
    return ids, mask


@pytest.fixture(scope="module", params=["none", "nf4"])
def sft_adapter(request, tmp_path_factory):
    """A trained-looking SFT adapter: fresh LoRA with its weights perturbed, saved in PEFT format."""
    args = tiny_args(request.param)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(f"sft-{request.param}") / "sft"
    model.save_adapter("policy", out)
    ids, mask = batch()
    model.eval()
    reference_logits = model.logits(ids, mask, "policy")
    return args, out, reference_logits


def ppo_model(args, sft_dir):
    return build_shared_model(args, [
        AdapterSpec("policy", trainable=True, init_from=str(sft_dir)),
        AdapterSpec("reference", trainable=False, init_from=str(sft_dir)),
        AdapterSpec("value", trainable=True, head=True),
        AdapterSpec("reward", trainable=False, head=True, head_from=saved_head(Path(sft_dir).parent / "head", 64)),
    ], vocab_size=VOCAB)


def test_reference_outputs_equal_the_sft_adapter_bit_for_bit(sft_adapter):
    args, sft_dir, sft_logits = sft_adapter
    model = ppo_model(args, sft_dir)
    ids, mask = batch()
    for mode in (False, True):  # frozen adapters carry no dropout, so train() mode is deterministic too
        model.train(mode)
        with torch.no_grad():
            assert torch.equal(model.logits(ids, mask, "reference"), sft_logits)
    model.eval()
    assert torch.equal(model.logits(ids, mask, "policy"), sft_logits)


def test_optimizer_step_moves_only_policy_value_and_value_head(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = ppo_model(args, sft_dir)
    before = {name: adapter_state(model, name) for name in model.adapter_names}
    base_before = {n: p.detach().clone() for n, p in model.peft.named_parameters() if "lora_" not in n}
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-2)
    model.train()
    ids, mask = batch()
    with torch.no_grad():
        ref = model.logits(ids, mask, "reference")
        reward = model.scores(ids, mask, "reward")
    loss = (model.logits(ids, mask, "policy") - ref).pow(2).mean() + (model.scores(ids, mask, "value") - reward).pow(2).mean()
    loss.backward()
    opt.step()
    after = {name: adapter_state(model, name) for name in model.adapter_names}
    changed = {name: any(not torch.equal(before[name][k], after[name][k]) for k in before[name]) for name in before}
    assert changed == {"policy": True, "reference": False, "value": True, "reward": False}
    assert any(k.startswith("head.") and not torch.equal(before["value"][k], after["value"][k]) for k in before["value"])
    for n, p in model.peft.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n


def test_frozen_adapters_and_heads_get_no_gradient_and_stay_out_of_the_optimizer(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = ppo_model(args, sft_dir)
    trainable = {id(p) for p in model.trainable_parameters()}
    for param, adapter in model._lora_params:
        assert (id(param) in trainable) == (adapter in ("policy", "value"))
    assert all(id(p) not in trainable for p in model.heads["reward"].parameters())
    assert all(id(p) in trainable for p in model.heads["value"].parameters())
    # Every switch keeps that split, whatever peft's set_adapter does to requires_grad.
    for name in ("reference", "reward", "value", "policy"):
        with model.use_adapter(name):
            assert {id(p) for p in model.parameters() if p.requires_grad} == trainable
    ids, mask = batch()
    model.train()
    # Frozen adapters and heads build no autograd graph even outside torch.no_grad().
    assert not model.logits(ids, mask, "reference").requires_grad
    assert not model.scores(ids, mask, "reward").requires_grad
    assert model.scores(ids, mask, "value").requires_grad


def test_active_adapter_is_restored_after_an_exception_inside_the_context(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = ppo_model(args, sft_dir)
    model.eval()
    ids, mask = batch()

    def raw_logits():  # whatever the model adds now, called past use_adapter
        with torch.no_grad():
            return model.causal_lm(input_ids=ids, attention_mask=mask).logits

    assert model.active_adapter == "policy"
    policy = raw_logits()
    with pytest.raises(RuntimeError, match="boom"):
        with model.use_adapter("reward"):
            assert model.active_adapter == "reward"
            with model.use_adapter("value"):
                assert not torch.equal(raw_logits(), policy)  # the value adapter (fresh: the base) runs
                raise RuntimeError("boom")
    assert model.active_adapter == "policy"
    assert torch.equal(raw_logits(), policy)  # the policy's LoRA outputs are added again
    with pytest.raises(KeyError, match="no adapter 'critic'"):
        with model.use_adapter("critic"):
            pass
    assert model.active_adapter == "policy"


def test_switching_adapters_never_copies_base_weights(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = ppo_model(args, sft_dir)
    pointers = {n: p.data_ptr() for n, p in model.peft.named_parameters() if "lora_" not in n}
    ids, mask = batch()
    with torch.no_grad():
        for name in ("reference", "value", "reward", "policy"):
            with model.use_adapter(name):
                model.logits(ids, mask, name)
    assert pointers == {n: p.data_ptr() for n, p in model.peft.named_parameters() if "lora_" not in n}

    # A switch allocates nothing at all (a temporary copy of a weight would show up here).
    from torch.profiler import ProfilerActivity, profile

    def allocations(body) -> list[tuple[str, int]]:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            body()
        return [(e.name, e.cpu_memory_usage) for e in prof.events() if e.cpu_memory_usage > 0]

    def switch_through_every_adapter():
        for name in ("reference", "value", "reward", "policy"):
            with model.use_adapter(name):
                pass

    assert allocations(switch_through_every_adapter) == []
    weight = next(p for n, p in model.peft.named_parameters() if "lora_" not in n)
    assert allocations(lambda: weight.detach().clone())  # the probe does see a copy


def test_checkpointed_backward_recomputes_each_layer_under_its_forward_adapter():
    """Gradients with checkpointing equal those without, when adapters switch between forward and backward."""
    grads = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_shared_model(tiny_args(checkpointing=checkpointing, lora_dropout=0.0), [
            AdapterSpec("policy", trainable=True), AdapterSpec("value", trainable=True, head=True)],
            vocab_size=VOCAB)
        with torch.no_grad():
            for p in model.trainable_parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model.train()
        ids, mask = batch()
        loss = model.scores(ids, mask, "value").pow(2).mean() + model.logits(ids, mask, "policy").logsumexp(-1).mean()
        loss.backward()  # the active adapter is "policy" here; the value layers must recompute under "value"
        grads[checkpointing] = [p.grad.clone() for p in model.trainable_parameters()]
    assert len(grads[True]) == len(grads[False])
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b)


def test_saved_adapter_loads_with_plain_peft_and_head_round_trips(tmp_path):
    from peft import PeftModel

    from trainer.model.loading import load_base_model

    args = tiny_args()
    model = build_shared_model(args, [AdapterSpec("reward", trainable=True, head=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = model.save_adapter("reward", tmp_path / "rm")
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / HEAD_FILE).is_file()
    model.eval()
    ids, mask = batch()
    expected_logits = model.logits(ids, mask, "reward")
    expected_scores = model.scores(ids, mask, "reward")

    plain = PeftModel.from_pretrained(load_base_model(args, vocab_size=VOCAB), str(out)).eval()
    positions = position_ids_from_mask(mask)  # the left-padded row is scored with generation's positions
    torch.testing.assert_close(plain(input_ids=ids, attention_mask=mask, position_ids=positions).logits,
                               expected_logits, rtol=0, atol=0)

    reloaded = build_shared_model(args, [AdapterSpec("reward", trainable=False, init_from=str(out), head=True)],
                                  vocab_size=VOCAB).eval()
    assert torch.equal(reloaded.scores(ids, mask, "reward"), expected_scores)


def test_missing_adapter_folder_is_a_clear_error(tmp_path):
    from foundation.cli import InputError

    with pytest.raises(InputError, match="nope is not a saved adapter .no adapter_config.json."):
        build_shared_model(tiny_args(), [AdapterSpec("policy", init_from=str(tmp_path / "nope"))], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="unique"):
        build_shared_model(tiny_args(), [AdapterSpec("policy"), AdapterSpec("policy")], vocab_size=VOCAB)


def test_left_padded_rows_score_like_unpadded_rows():
    """Positions come from the mask, so left padding changes nothing for the real tokens."""
    model = build_shared_model(tiny_args(), [AdapterSpec("value", trainable=True, head=True)], vocab_size=VOCAB).eval()
    ids = batch(b=2, t=8)[0][:1]
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    with torch.no_grad():
        plain = model.logits(ids, torch.ones_like(ids), "value")
        left = model.logits(padded, mask, "value")
        tail = model.logits(padded, mask, "value", keep_last=5)
        values = model.scores(padded, mask, "value", keep_last=5)
    torch.testing.assert_close(left[:, 3:], plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tail, left[:, -5:], rtol=1e-5, atol=1e-6)
    assert values.shape == (1, 5)


def labelled_batch(seed=0):
    """Right-padded rows whose labels cover only a completion tail (-100 on prompt and padding)."""
    ids, _ = batch(seed, b=3, t=12)
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = ids.clone()
    labels[0, :7] = -100
    labels[1, :4] = -100
    labels[2, :5] = -100
    labels[2, 9:] = -100
    return ids, mask, labels


@pytest.mark.parametrize("checkpointing", [False, True])
def test_label_logprobs_equal_full_logits_log_probs_in_value_and_gradient(checkpointing):
    from trainer.model.logprobs import shift_for_next_token, token_logprobs

    torch.manual_seed(0)
    model = build_shared_model(tiny_args(checkpointing=checkpointing, lora_dropout=0.0),
                               [AdapterSpec("policy", trainable=True)], vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.train()
    ids, mask, labels = labelled_batch()
    weights = torch.linspace(0.5, 2.0, labels.shape[1] - 1)  # a loss that weights positions unequally

    results = []
    for path in ("full", "labelled"):
        model.zero_grad(set_to_none=True)
        if path == "full":
            logp = token_logprobs(*shift_for_next_token(model.logits(ids, mask, "policy"), labels))
        else:
            logp = model(ids, mask, adapter="policy", output="logprobs", labels=labels)
        (logp * weights).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.trainable_parameters()]))
    (full, full_grads), (mine, my_grads) = results
    assert mine.shape == (3, 11)
    assert torch.equal(mine == 0, labels[:, 1:] == -100)  # zero exactly where no label, nowhere else
    torch.testing.assert_close(mine, full, rtol=1e-5, atol=1e-5)
    for a, b in zip(full_grads, my_grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_label_logprobs_run_the_lm_head_on_labelled_positions_only_in_chunks(monkeypatch):
    import trainer.model.logprobs

    model = build_shared_model(tiny_args(), [AdapterSpec("policy", trainable=False)], vocab_size=VOCAB).eval()
    ids, mask, labels = labelled_batch()
    rows, whole = [], []
    chunked = trainer.model.logprobs.head_logprobs
    monkeypatch.setattr(trainer.model.logprobs, "head_logprobs", lambda h, *a, **k: rows.append(h.shape) or chunked(h, *a, **k))
    hook = model.causal_lm.get_output_embeddings().register_forward_hook(lambda m, inp, out: whole.append(out.shape))
    try:
        with torch.no_grad():
            model(ids, mask, adapter="policy", output="logprobs", labels=labels)
    finally:
        hook.remove()
    assert rows == [torch.Size([int((labels[:, 1:] != -100).sum()), model.causal_lm.config.hidden_size])]
    assert whole == []  # the head module never built a (tokens x vocab) tensor
    with pytest.raises(ValueError, match="needs labels"):
        model(ids, mask, adapter="policy", output="logprobs")


def test_forward_is_a_table_of_the_explicit_methods_for_wrappers(sft_adapter):
    """DDP and DeepSpeed call `forward`: each output name gives exactly what its method gives."""
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(args, sft_dir).eval()
    ids, mask, labels = labelled_batch()
    segments = torch.tensor([[0] * 4 + [1] * 4 + [2] * 4, [0] * 3 + [1] * 5 + [2] * 3 + [-1]] * 3)[:3]
    with torch.no_grad():
        pairs = {"pair_scores": model.pair_scores(ids, segments, "reward"),
                 "pair_logprobs": model.pair_logprobs(ids, segments, "policy", labels)}
        for output, adapter, want in [
            ("logits", "policy", model.logits(ids, mask, "policy", 4)),
            ("scores", "value", model.scores(ids, mask, "value", 4)),
            ("hidden", "reference", model.hidden_states(ids, mask, "reference", 4)),
            ("logprobs", "policy", model.label_logprobs(ids, mask, "policy", labels)),
            ("pair_scores", "reward", pairs["pair_scores"]),
            ("pair_logprobs", "policy", pairs["pair_logprobs"]),
        ]:
            got = model(ids, mask, adapter=adapter, output=output, keep_last=4, labels=labels, segments=segments)
            for a, b in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
                assert torch.equal(a, b), output
        assert [o.shape for o in model(ids, mask, ("policy", "value"), ("logits", "scores"))] == [
            model.logits(ids, mask, "policy").shape, model.scores(ids, mask, "value").shape]
    with pytest.raises(ValueError, match="unknown output 'values'"):
        model(ids, mask, adapter="value", output="values")
    with pytest.raises(ValueError, match="need segments"):
        model(ids, mask, adapter="reward", output="pair_scores")


def test_a_frozen_head_without_saved_weights_is_an_error_naming_the_folder(sft_adapter):
    """A reward head is never trained in PPO or evaluation: a random one would score noise silently."""
    from trainer.model.shared_base import HeadMissingError

    args, sft_dir, _ = sft_adapter
    with pytest.raises(HeadMissingError, match=f"{sft_dir / HEAD_FILE} is missing"):
        build_shared_model(args, [AdapterSpec("reward", init_from=str(sft_dir), head=True)], vocab_size=VOCAB)
    with pytest.raises(HeadMissingError, match="no saved head was given"):
        build_shared_model(args, [AdapterSpec("reward", head=True)], vocab_size=VOCAB)
    # A trainable head may start fresh (the reward stage, PPO's value head).
    model = build_shared_model(args, [AdapterSpec("value", trainable=True, init_from=str(sft_dir), head=True)],
                               vocab_size=VOCAB)
    assert "value" in model.heads


def perturbed_ppo_model(args, sft_dir):
    """PPO's four adapters, each with distinct weights (policy moved off the SFT copy, value non-zero)."""
    model = ppo_model(args, sft_dir)
    torch.manual_seed(7)
    with torch.no_grad():
        for param, adapter in model._lora_params:
            if adapter in ("policy", "value", "reward"):
                param.add_(torch.randn_like(param) * 0.05)
    return model


def assert_equal_but_rounding(got: torch.Tensor, want: torch.Tensor, quantization: str, what: str = "") -> None:
    """A routed pass against one pass per group: each group's LoRA products come from matmuls over all the
    groups' stacked weights, which sum in another order - in fp32 equal to 1e-5, in bf16 (the 4-bit models'
    compute dtype) to its rounding, which a layer passes on to the next."""
    if quantization == "none":  # fp32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
    else:
        assert got.shape == want.shape and (got.float() - want.float()).norm() <= 1e-2 * want.float().norm(), what


FOUR = (("policy", "logits"), ("reference", "logits"), ("value", "scores"), ("reward", "scores"))


@pytest.mark.parametrize("keep_last", [0, 4])
def test_a_fused_pass_gives_each_adapter_what_its_own_pass_gives(sft_adapter, keep_last):
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(args, sft_dir)
    model.eval()
    ids, mask = batch(b=3)
    adapters, outputs = zip(*FOUR)
    with torch.no_grad():
        fused = model(ids, mask, adapter=adapters, output=outputs, keep_last=keep_last)
        separate = [model(ids, mask, adapter=a, output=o, keep_last=keep_last) for a, o in FOUR]
    assert model.routable and model.active == "policy"  # the route is gone after the pass
    for (adapter, _), got, want in zip(FOUR, fused, separate):
        assert got.shape == want.shape, adapter
        assert_equal_but_rounding(got, want, args.quantization, adapter)
    # the groups really differ: each got its own adapter
    assert not torch.allclose(fused[0], fused[1]) and not torch.allclose(fused[2], fused[3])


def test_where_routing_cannot_run_the_adapters_run_one_pass_each_and_say_so_once(sft_adapter, monkeypatch, caplog):
    """A model whose adapters cannot be routed (not plain LoRA on linear layers), or whose logits are not the LM
    head of the last hidden state (soft-capped or scaled), runs a fused pass as one pass per adapter: the
    routed pass's outputs, and one log line per reason however many passes."""
    from trainer.model.shared_base import SharedBaseModel

    args, sft_dir, _ = sft_adapter
    adapters, outputs = zip(*FOUR)
    ids, mask = batch(b=3)
    routed = perturbed_ppo_model(args, sft_dir).eval()
    with torch.no_grad():
        want = routed.fused(ids, mask, adapters, outputs, keep_last=4)
    capped = perturbed_ppo_model(args, sft_dir).eval()
    capped.causal_lm.config.final_logit_softcapping = 30.0  # read as a flag only: Llama's forward ignores it
    monkeypatch.setattr(SharedBaseModel, "_install_routing", lambda self: False)  # as for DoRA or LoRA on a conv
    unroutable = perturbed_ppo_model(args, sft_dir).eval()
    passes, use_adapter = [], SharedBaseModel.use_adapter
    monkeypatch.setattr(SharedBaseModel, "use_adapter", lambda self, name: passes.append(name) or use_adapter(self, name))
    with caplog.at_level("INFO", "trainer.model.routing"), torch.no_grad():
        for model in (unroutable, capped, unroutable, capped):
            passes.clear()
            got = model.fused(ids, mask, adapters, outputs, keep_last=4)
            assert passes == list(adapters)  # one pass per adapter
            for adapter, g, w in zip(adapters, got, want):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=adapter)
        passes.clear()
        capped.fused(ids, mask, ("value", "reward"), ("scores", "scores"), keep_last=4)  # no logits: routed
    assert not unroutable.routable and capped.routable and passes == [(("value", 3), ("reward", 3))]
    said = [r.message for r in caplog.records if "one pass each" in r.message]
    assert len(said) == 2 and "not plain LoRA" in said[0] and "soft-capped" in said[1]


@pytest.mark.parametrize("asked", [
    dict(reference=True, value=True, reward_adapter="reward"),  # PPO
    dict(reference=True, value=False, reward_adapter="reward"),  # GRPO
    dict(reference=False, value=False, reward_adapter="reward"),  # GRPO: beta 0
    dict(reference=False, value=False, reward_adapter=None),  # GRPO: beta 0, scripted reward: nothing to score
], ids=["ppo", "grpo", "grpo-reward-only", "none"])
def test_rollout_scores_give_what_is_asked_from_one_pass_and_none_for_the_rest(sft_adapter, asked, monkeypatch):
    """PPO's and GRPO's scoring helper: the groups asked for, equal to one pass per adapter, others None."""
    from trainer.model.shared_base import SharedBaseModel
    from trainer.rl.scoring import rollout_scores

    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(args, sft_dir)
    model.eval()
    ids, mask = batch(b=3)
    response_mask = torch.ones(3, 4, dtype=torch.long)
    response_mask[0, 2:] = 0  # row 0 ended after two tokens: its score is read there
    routes = []
    fused = SharedBaseModel.fused
    monkeypatch.setattr(SharedBaseModel, "fused", lambda self, i, m, adapters, *a, **k: routes.append(tuple(adapters))
                        or fused(self, i, m, adapters, *a, **k))
    with torch.no_grad():
        one = rollout_scores(model, ids, mask, response_mask, 0.7, **asked)
        monkeypatch.setattr(SharedBaseModel, "fused", SharedBaseModel._separate_passes)
        each = rollout_scores(model, ids, mask, response_mask, 0.7, **asked)  # one pass per adapter
    names = ("ref_logprobs", "values", "scores")
    given = {"ref_logprobs": asked["reference"], "values": asked["value"], "scores": asked["reward_adapter"] is not None}
    for name, got, want in zip(names, one, each):
        assert (got is not None) == given[name], name
        if got is not None:
            assert got.shape == ((3,) if name == "scores" else (3, 4)), name
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    wanted = tuple(a for a, on in (("reference", asked["reference"]), ("value", asked["value"]),
                                    ("reward", asked["reward_adapter"] is not None)) if on)
    assert routes == ([wanted] if wanted else [])  # one routed pass; nothing run when nothing is asked
    if asked["reward_adapter"]:  # the score is the reward head's at each row's last response token
        scores = model(ids, mask, adapter="reward", output="scores", keep_last=4)
        torch.testing.assert_close(one[2], torch.stack([scores[0, 1], scores[1, 3], scores[2, 3]]).float())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_fused_policy_and_value_pass_backpropagates_as_two_passes_do(sft_adapter, checkpointing):
    args, sft_dir, _ = sft_adapter
    # train mode without dropout (PPO turns LoRA dropout off: its ratio must start at 1)
    model = perturbed_ppo_model(tiny_args(args.quantization, checkpointing=checkpointing, lora_dropout=0.0), sft_dir)
    model.train()
    ids, mask = batch(b=3)
    target = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))

    def loss_of(logits, values):
        return logits.float().log_softmax(-1)[..., 0].sum() + (values - target).pow(2).sum()

    grads = []
    for fused in (True, False):
        model.zero_grad(set_to_none=True)
        passes = model.fused if fused else model._separate_passes
        logits, values = passes(ids, mask, ("policy", "value"), ("logits", "scores"), keep_last=5)
        loss_of(logits, values).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.trainable_parameters()])
    assert all(g is not None for g in grads[0]) and any(g.abs().sum() > 0 for g in grads[0])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p, a in model._lora_params if a in ("reference", "reward"))


def test_under_autocast_the_lora_input_skips_its_fp32_round_trip_and_nothing_changes(monkeypatch):
    """Under bf16 autocast a LoRA layer's bf16 input is no longer cast to the adapter's fp32 and back (two
    kernels per layer and pass): a fused policy and value pass gives the same outputs and gradients, bit for
    bit, as with the round trip."""
    from trainer.model import routing

    torch.manual_seed(0)
    model = build_shared_model(tiny_args(dtype="bfloat16", lora_dropout=0.0),
                               [AdapterSpec("policy", trainable=True), AdapterSpec("value", trainable=True, head=True)],
                               vocab_size=VOCAB)
    with torch.no_grad():
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.train()
    ids, mask = batch(b=3)
    runs = []
    for round_trip in (False, True):
        if round_trip:
            monkeypatch.setattr(routing, "_in_autocast_dtype", lambda x: False)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, values = model.fused(ids, mask, ("policy", "value"), ("logits", "scores"), keep_last=5)
            (logits.float().log_softmax(-1)[..., 0].sum() + values.float().pow(2).sum()).backward()
        runs.append([logits, values, *(p.grad.clone() for p in model.trainable_parameters() if p.grad is not None)])
    assert len(runs[0]) > 2 and len(runs[0]) == len(runs[1])
    for got, want in zip(*runs):
        assert torch.equal(got, want)


ROUTES = {"equal groups": ((("policy", 3), ("value", 3), ("reward", 3)), (3, 3, 3)),
          "unequal groups": ((("policy", 2), ("reference", 1), ("value", 3)), (2, 1, 3))}


@pytest.mark.parametrize("route", ROUTES, ids=list(ROUTES))
@pytest.mark.parametrize("grad", [False, True], ids=["no grad", "grad"])
def test_a_routed_pass_gives_each_row_group_what_a_pass_under_its_adapter_gives(sft_adapter, route, grad):
    """Each group of a routed batch - equal or unequal groups, with autograd (a copy of the base output per
    group) or without (added in place) - gets the hidden states and gradients that a pass of its own rows
    under its own adapter gives."""
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(tiny_args(args.quantization, lora_dropout=0.0), sft_dir)
    model.train()
    steps, sizes = ROUTES[route]
    ids, mask = batch(b=sum(sizes))

    def run(routed: bool):
        model.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            if routed:
                hidden = model.hidden_states(ids, mask, steps)
            else:
                starts = [sum(sizes[:g]) for g in range(len(sizes))]
                hidden = torch.cat([model.hidden_states(ids[s : s + rows], mask[s : s + rows], name)
                                    for (name, rows), s in zip(steps, starts)])
        if not grad:
            return hidden, []
        (hidden.pow(2).mean() + hidden[:, -1].sum()).backward()
        return hidden.detach(), [p.grad.clone() for p in model.trainable_parameters() if p.grad is not None]

    got, got_grads = run(True)
    want, want_grads = run(False)
    assert_equal_but_rounding(got, want, args.quantization)
    trainable_lora = [p for p, adapter in model._lora_params if model.specs[adapter].trainable]
    assert len(got_grads) == len(want_grads) == (len(trainable_lora) if grad else 0)  # the heads did not run
    for g, w in zip(got_grads, want_grads):
        # the backward sums over another batch layout (all groups' rows, other groups' columns zero): in fp32 the
        # sums round differently in the last bits, in bf16 compute by ~0.7% here
        assert (g - w).norm() <= (1e-5 if args.quantization == "none" else 2e-2) * w.norm()


def test_each_group_of_a_routed_training_pass_goes_through_its_own_adapter_s_dropout(sft_adapter):
    """Training with LoRA dropout, a routed pass drops each group's rows by its own adapter's dropout: at rate 1
    the trainable policy's rows get no LoRA output at all (the base's), the frozen reference rows (no dropout)
    the same as a pass under their adapter."""
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(tiny_args(args.quantization, lora_dropout=0.5), sft_dir)
    for layer in model.lora_layers:
        layer.lora_dropout["policy"].p = 1.0  # past what the settings allow: every input dropped
    model.train()
    ids, mask = batch(b=4)
    with torch.no_grad():
        routed = model.hidden_states(ids, mask, (("policy", 2), ("reference", 2)))
        with base_only(model):
            base = model.hidden_states(ids, mask, "policy")
        reference = model.hidden_states(ids[2:], mask[2:], "reference")
    assert type(model.lora_layers[0].lora_dropout["reference"]).__name__ == "Identity"
    assert_equal_but_rounding(routed[:2], base[:2], args.quantization, "policy rows")
    assert_equal_but_rounding(routed[2:], reference, args.quantization, "reference rows")
    assert not torch.allclose(reference, base[2:])


def test_a_routed_pass_launches_as_many_operations_for_three_groups_as_for_two(sft_adapter):
    """The routed LoRA layers multiply every group's rows by all the groups' stacked weights at once: the
    operations launched per pass (what a GPU pays per layer in host time) do not grow with the groups, where a
    loop over groups launched each layer's LoRA products once per group."""
    from conftest import dispatch_counter

    def launched():  # the operations a pass launches: views launch nothing
        return dispatch_counter(lambda func: not func.is_view)

    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(tiny_args(args.quantization, lora_dropout=0.0), sft_dir)
    model.eval()
    ids, mask = batch(b=6)
    counts = []
    for route in [(("policy", 3), ("value", 3)), (("policy", 2), ("value", 2), ("reward", 2)),
                  (("policy", 1), ("reference", 2), ("value", 1), ("reward", 2))]:
        with torch.no_grad():
            model.hidden_states(ids, mask, route)  # the route's first pass makes its scales (`Routing._scales_of`)
            with launched() as count:
                model.hidden_states(ids, mask, route)
        counts.append(count.count)
    with torch.no_grad(), launched() as one:
        model.hidden_states(ids, mask, "policy")
    assert counts[0] == counts[1] == counts[2]
    # beside one adapter's pass, per LoRA layer: the two stacks of the weights
    assert counts[0] - one.count == 2 * len(model.lora_layers)


def test_routing_refuses_unknown_adapters_and_mismatched_rows(sft_adapter):
    args, sft_dir, _ = sft_adapter
    model = ppo_model(args, sft_dir)
    ids, mask = batch(b=2)
    with pytest.raises(KeyError, match="critic"):
        model.fused(ids, mask, ("policy", "critic"), ("logits", "scores"))
    with pytest.raises(ValueError, match="routed batch has 2 rows"), torch.no_grad():
        model.hidden_states(ids, mask, (("policy", 1), ("value", 2)))
    assert model.active == "policy"


COMPILED_PASSES = [(("policy", "value"), ("logits", "scores")), ("value", "scores"), ("policy", "logits"),
                   (("value", "policy"), ("scores", "logits"))]


def train_passes(model, ids, mask, monkeypatch, passes=COMPILED_PASSES):
    """Each pass's outputs and trainable gradients (forward + backward in train mode), and how many layer
    calls went through `CompiledLayer` and through the layer forward compiled alone."""
    from conftest import compiled_calls

    model.train()
    results, alone = [], []
    wrappers = [m.forward for m in model.modules() if hasattr(m.forward, "compiled_checkpointed")]
    for w in wrappers:
        monkeypatch.setattr(w, "compiled", counting(w.compiled, alone))
    with compiled_calls(monkeypatch) as calls:
        for adapter, output in passes:
            model.zero_grad(set_to_none=True)
            outs = model(ids, mask, adapter=adapter, output=output, keep_last=5)
            outs = outs if isinstance(outs, tuple) else (outs,)
            sum(o.log_softmax(-1).mean() if o.dim() == 3 else o.pow(2).mean() for o in outs).backward()
            grads = [p.grad.clone() for p in model.trainable_parameters() if p.grad is not None]
            results.append(([o.detach() for o in outs], grads))
    return results, len(calls), len(alone)


def counting(fn, calls):
    def counted(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return counted


def assert_same_passes(results, want, passes=COMPILED_PASSES):
    for (want_outs, want_grads), (outs, grads), (adapter, _) in zip(want, results, passes, strict=True):
        for got, w in zip(outs, want_outs, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{adapter}: {m}")
        assert len(grads) == len(want_grads) > 0
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6, msg=lambda m: f"{adapter}: {m}")


def test_compiled_layers_give_the_eager_outputs_and_gradients_and_generate_eagerly(sft_adapter, monkeypatch,
                                                                                 traced_not_generated):
    """--compile_layers: checkpointed passes that train - routed (policy + value) and under one adapter (value,
    then policy) - give the eager model's outputs and gradients to fp32 rounding, each under its own adapters (a
    graph compiled under one route is not reused under another). Each layer compiles WITH its checkpoint: one
    call per layer and pass, the recomputation inside the compiled backward (the forward compiled alone never
    runs). Every LoRA layer's forward is one function bound to its layer, so the decoder layers trace alike: one
    graph per route for both layers (an object per layer, guarded by its identity, compiled each layer anew until
    torch's variant limit). Passes without autograd (scoring, generation) run eagerly and compile nothing."""
    import torch._dynamo
    from conftest import compiled_calls
    from torch._dynamo.utils import counters

    from trainer.model.decode import Generator, Sampling

    args, sft_dir, _ = sft_adapter
    if args.quantization != "none":
        pytest.skip("compiled 4-bit layers are a CUDA path")
    models = [perturbed_ppo_model(tiny_args(checkpointing=True, lora_dropout=0.0, compile_layers=c), sft_dir)
              for c in (False, True)]
    assert models[0].compiled_parts == 0 and models[1].compiled_parts == 2  # one graph per decoder layer
    ids, mask = batch(b=4, t=12)
    passes = COMPILED_PASSES[:3]  # the routed pass, then two adapters alone: one route compiled, then another
    want, eager_calls, _ = train_passes(models[0], ids, mask, monkeypatch, passes)
    assert len({layer.forward.__func__ for layer in models[1].lora_layers}) == 1 < len(models[1].lora_layers)
    torch._dynamo.reset()  # nothing compiled by an earlier test to reuse: every graph below is counted
    before = counters["stats"]["unique_graphs"]
    got, calls, alone = train_passes(models[1], ids, mask, monkeypatch, passes)
    assert eager_calls == 0 and calls == 2 * len(passes) and alone == 0
    assert counters["stats"]["unique_graphs"] - before == len(passes)  # one graph per route, not per layer
    assert all(m.forward.whole for m in models[1].modules() if hasattr(m.forward, "whole"))
    assert_same_passes(got, want, passes)
    graphs = counters["stats"]["unique_graphs"]
    with compiled_calls(monkeypatch) as calls, torch.no_grad():
        models[1].fused(ids, mask, ["reference", "value", "reward"], ["logits", "scores", "scores"], keep_last=5)
        sequences = [Generator(m).sample(ids, mask, Sampling(max_new_tokens=4, temperature=0), eos_id=1, pad_id=0).tokens
                     for m in models]
    assert not calls and counters["stats"]["unique_graphs"] == graphs  # scoring and decoding: eager, nothing compiled
    assert torch.equal(sequences[0], sequences[1])


def test_compiled_layers_that_cannot_compile_with_their_checkpoint_stay_exact(sft_adapter, monkeypatch, caplog,
                                                                              traced_not_generated):
    """Where a checkpointed layer does not compile whole - past torch's variant limit (here 1), or a graph
    break - its forward compiles inside transformers' eager checkpoint (and past the limit there too, runs
    eagerly), recomputing under the route of its forward: the eager outputs and gradients, said once."""
    import torch._dynamo

    args, sft_dir, _ = sft_adapter
    if args.quantization != "none":
        pytest.skip("compiled 4-bit layers are a CUDA path")
    ids, mask = batch(b=4, t=12)
    # Two routes, one past the limit. The variant count is per code object: the first route is the one the test
    # above compiled (reused here as is), the second one it did not compile. Run alone, the first compiles.
    passes = [COMPILED_PASSES[0], COMPILED_PASSES[3]]
    eager = perturbed_ppo_model(tiny_args(checkpointing=True, lora_dropout=0.0), sft_dir)
    want, _, _ = train_passes(eager, ids, mask, monkeypatch, passes)

    limited = perturbed_ppo_model(tiny_args(checkpointing=True, lora_dropout=0.0, compile_layers=True), sft_dir)
    with torch._dynamo.config.patch(recompile_limit=1), caplog.at_level("WARNING", "trainer.model.compiled"):
        got, _, alone = train_passes(limited, ids, mask, monkeypatch, passes)
    assert_same_passes(got, want, passes)
    assert alone > 0 and sum("variants than torch compiles" in r.message for r in caplog.records) == 1

    def broken(forward, layer, *a, **kw):
        torch._dynamo.graph_break()
        return forward(layer, *a, **kw)

    caplog.clear()
    breaking = perturbed_ppo_model(tiny_args(checkpointing=True, lora_dropout=0.0, compile_layers=True), sft_dir)
    wrappers = [m.forward for m in breaking.modules() if hasattr(m.forward, "whole")]
    for w in wrappers:
        w.compiled_checkpointed = torch.compile(broken, dynamic=True, fullgraph=True)
    with caplog.at_level("WARNING", "trainer.model.compiled"):
        got, _, alone = train_passes(breaking, ids, mask, monkeypatch, passes)
    assert_same_passes(got, want, passes)
    assert alone > 0 and not any(w.whole for w in wrappers)
    assert sum("does not compile with its checkpoint" in r.message for r in caplog.records) == 1


def test_compiled_checkpointed_layers_recompute_the_dropout_of_their_forward(sft_adapter, traced_not_generated):
    """With LoRA dropout, a layer compiled with its checkpoint recomputes, in the backward, the masks its
    forward drew: the gradient is the derivative of that very (reseeded, compiled) forward - a central
    difference along the gradient agrees with its norm (other masks were measured 1.6% off) - and a second
    backward from the same seed gives it again."""
    args, sft_dir, _ = sft_adapter
    if args.quantization != "none":
        pytest.skip("compiled 4-bit layers are a CUDA path")
    model = perturbed_ppo_model(tiny_args(checkpointing=True, lora_dropout=0.3, compile_layers=True), sft_dir)
    model.train()
    ids, mask = batch(b=4, t=12)
    params = model.trainable_parameters()

    def loss() -> torch.Tensor:
        torch.manual_seed(123)
        logits, scores = model(ids, mask, adapter=("policy", "value"), output=("logits", "scores"), keep_last=5)
        return logits.log_softmax(-1)[..., :7].mean() + scores.pow(2).mean()

    grads = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss().backward()
        grads.append([p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads[0]))
    assert norm > 0
    assert all(m.forward.whole for m in model.modules() if hasattr(m.forward, "whole"))
    eps, values = 3e-3, []
    for sign in (1, -1):
        with torch.no_grad():
            for p, g in zip(params, grads[0]):
                p.add_(sign * eps * g / norm)
        values.append(loss().item())  # with autograd recording: the compiled forward, its masks
        with torch.no_grad():
            for p, g in zip(params, grads[0]):
                p.sub_(sign * eps * g / norm)
    slope = (values[0] - values[1]) / (2 * eps)
    assert slope == pytest.approx(norm.item(), rel=2e-3)


# ---- RL log-probs from the hidden states (no tokens x vocabulary tensor) ---------------------------
def full_logits_scoring(model, ids, mask, width, temperature):
    """What PPO's update pass gave from whole logits: the reference the chunked head is held to."""
    from trainer.rl.scoring import next_token_logprobs

    logits, values = model.fused(ids, mask, ("policy", "value"), ("logits", "scores"), keep_last=width + 1)
    logprobs, entropy = next_token_logprobs(logits[:, :-1], ids[:, -width:], temperature, with_entropy=True)
    return logprobs, entropy, values[:, :-1]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rl_logprobs_and_entropy_from_hidden_states_equal_full_logits_in_value_and_gradient(sft_adapter, temperature):
    """PPO's update pass (policy log-probs, entropy, values), GRPO's (policy log-probs) and the rollout's
    reference log-probs, taken from the hidden states a chunk at a time, equal what the whole logits give,
    in value and in every trainable gradient (entropy's included, for an entropy bonus). In bf16 (NF4 here)
    the whole-logits path rounds more (logits / temperature in bf16): the tolerance is bf16's."""
    from trainer.rl.scoring import policy_and_values, response_logprobs, rollout_scores

    args, sft_dir, _ = sft_adapter
    tol = 1e-5 if args.quantization == "none" else 2e-3
    model = perturbed_ppo_model(tiny_args(args.quantization, lora_dropout=0.0), sft_dir)
    model.train()
    ids, mask = batch(b=3)
    width = 5
    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(3, width, generator=g) for _ in range(3)]
    got_grads, want_grads = [], []
    for scoring, grads in ((lambda: policy_and_values(model, ids, mask, width, temperature), got_grads),
                           (lambda: full_logits_scoring(model, ids, mask, width, temperature), want_grads)):
        model.zero_grad(set_to_none=True)
        outputs = scoring()
        sum((o * w).sum() for o, w in zip(outputs, weights)).backward()
        grads.append([o.detach() for o in outputs])
        grads.append([None if p.grad is None else p.grad.clone() for p in model.trainable_parameters()])
    for got, want in zip(got_grads[0], want_grads[0]):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert any(p is not None and p.abs().sum() > 0 for p in got_grads[1])
    for got, want in zip(got_grads[1], want_grads[1]):
        if args.quantization == "none":  # fp32 throughout
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
        else:  # NF4 computes in bf16, where the whole-logits path rounds its two gradients apart before summing
            assert (got.float() - want.float()).norm() <= 3e-2 * want.float().norm()

    from trainer.rl.scoring import next_token_logprobs

    logits = model.logits(ids, mask, "policy", keep_last=width + 1)
    want = next_token_logprobs(logits[:, :-1], ids[:, -width:], temperature)[0]
    torch.testing.assert_close(response_logprobs(model, ids, mask, width, "policy", temperature)[0], want,
                               rtol=tol, atol=tol)
    with torch.no_grad():
        ref_logits = model.logits(ids, mask, "reference", keep_last=width + 1)
        want_ref = next_token_logprobs(ref_logits[:, :-1], ids[:, -width:], temperature)[0]
        response_mask = torch.ones(3, width, dtype=torch.long)
        got_ref = rollout_scores(model, ids, mask, response_mask, temperature, reference=True, value=False,
                                 reward_adapter=None)[0]
    torch.testing.assert_close(got_ref, want_ref, rtol=tol, atol=tol)


class VocabularyWide:
    """Every tensor an operator allocates (views left out: the head's transposed weight), forward or
    backward, with the vocabulary as its last dimension: the most positions any one of them spans."""

    def __init__(self, vocab: int) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        seen = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func.is_view:
                    return out
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == vocab:
                        seen.most_positions = max(seen.most_positions, t.numel() // vocab)
                return out

        self.most_positions = 0
        self.mode = Mode()


def test_no_tokens_by_vocabulary_tensor_is_allocated_in_rl_scoring_or_the_update(sft_adapter, monkeypatch):
    """Measured on every operator's output: PPO's update pass (forward and backward), GRPO's, and the
    rollout's reference pass hold at most one chunk of positions by the vocabulary; the whole-logits path,
    watched the same way, holds all of them (the watch can see what it must not find)."""
    import profiling.activations
    from trainer.rl.scoring import policy_and_values, response_logprobs, rollout_scores

    chunk = 4
    monkeypatch.setattr(profiling.activations, "HEAD_CHUNK_ELEMENTS", chunk * VOCAB)
    args, sft_dir, _ = sft_adapter
    model = perturbed_ppo_model(tiny_args(args.quantization, lora_dropout=0.0), sft_dir)
    model.train()
    ids, mask = batch(b=3)
    width = 5  # 15 response positions, four chunks of at most 4
    watch = VocabularyWide(VOCAB)
    with watch.mode:
        logprobs, entropy, values = policy_and_values(model, ids, mask, width, 0.7)
        (logprobs.sum() + 0.01 * entropy.sum() + values.sum()).backward()
        response_logprobs(model, ids, mask, width, "policy", 0.7)[0].sum().backward()
        with torch.no_grad():
            rollout_scores(model, ids, mask, torch.ones(3, width, dtype=torch.long), 0.7, reference=True,
                           value=True, reward_adapter="reward")
    assert 0 < watch.most_positions <= chunk
    whole = VocabularyWide(VOCAB)
    with whole.mode:
        full_logits_scoring(model, ids, mask, width, 0.7)
    assert whole.most_positions >= 3 * width

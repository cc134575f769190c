"""One row per preference pair (the prompt once): the mask, positions and predicting positions by hand, and
rewards, DPO log-probs and their gradients equal to the two-rows-per-pair layout."""

from __future__ import annotations

import pytest
import torch


def test_segments_give_the_pair_mask_positions_and_predicting_positions_by_hand():
    from trainer.model.pairs import last_of, pair_attention_mask, pair_positions, predicting_positions

    #            prompt   chosen  rejected  pad
    seg = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1]])
    assert pair_positions(seg).tolist() == [[0, 1, 2, 3, 4, 3, 4, 5, 0]]  # both completions continue at 3
    # token 5 (first rejected) is predicted from the last prompt token (2), not from the chosen token 4
    assert predicting_positions(seg)[0, 3:8].tolist() == [2, 3, 2, 5, 6]
    assert last_of(seg, 1).tolist() == [4] and last_of(seg, 2).tolist() == [7]
    mask = pair_attention_mask(seg, torch.float32, additive=False)[0, 0]
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 2, 5, 6]  # prompt + its own segment, never chosen
    assert mask[4].nonzero().flatten().tolist() == [0, 1, 2, 3, 4]
    assert mask[8].nonzero().flatten().tolist() == [8]  # padding sees itself only (no empty softmax row)
    additive = pair_attention_mask(seg, torch.float32, additive=True)[0, 0]
    assert additive[6, 3] == torch.finfo(torch.float32).min and additive[6, 2] == 0


def test_an_empty_completion_is_read_at_the_last_prompt_token_not_at_column_minus_one():
    from trainer.model.pairs import last_of

    #                    prompt   chosen  pad       prompt  rejected pad
    seg = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [0, 0, 2, 2, 2, -1, -1]])
    assert last_of(seg, 1).tolist() == [4, 1]  # row 1 has no chosen token: its last prompt token
    assert last_of(seg, 2).tolist() == [2, 4]


@pytest.fixture(scope="module")
def examples(shared_data, smol_tokenizer):
    from foundation.settings import DataArguments
    from trainer.data.hh_rlhf import load_pairs
    from trainer.data.tokenization import tokenize_pairs

    args = DataArguments(dataset=str(shared_data / "helpful-base"), max_length=96, min_prompt_tokens=4)
    pairs, _ = load_pairs(args)
    return tokenize_pairs(pairs[:40], smol_tokenizer, args)[0][:4]


def tiny_model(vocab: int, attention: str):
    from foundation.settings import ModelArguments
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8, gradient_checkpointing=False,
                          attn_implementation=attention)
    model = build_shared_model(args, [AdapterSpec("policy", trainable=True, head=True)], vocab_size=vocab,
                               device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero LoRA B so the adapter matters
        for p in model.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_one_row_per_pair_scores_and_log_probs_equal_two_rows_per_pair_with_the_same_gradients(
        examples, smol_tokenizer, attention):
    from trainer.data.collators import PairCollator, SharedPromptPairCollator
    from trainer.dpo import sequence_logprobs
    from trainer.reward import pair_rewards

    model = tiny_model(len(smol_tokenizer), attention)
    assert model.shares_pair_prompts
    pad = smol_tokenizer.pad_token_id
    shared, rows = SharedPromptPairCollator(pad)(examples), PairCollator(pad)(examples)
    assert shared["input_ids"].shape[0] == len(examples) and rows["input_ids"].shape[0] == 2 * len(examples)
    assert shared["attention_mask"].sum() < rows["attention_mask"].sum()  # the prompts once, not twice

    def outputs(batch):
        model.zero_grad(set_to_none=True)
        rc, rr = pair_rewards(model, batch, adapter="policy")
        lc, lr = sequence_logprobs(model, batch, "policy")
        (rc.sum() - 2 * rr.sum() + 0.1 * lc.sum() - 0.3 * lr.sum()).backward()
        grads = [p.grad.clone() for p in model.trainable_parameters()]
        return [t.detach() for t in (rc, rr, lc, lr)], grads

    (shared_out, shared_grads), (row_out, row_grads) = outputs(shared), outputs(rows)
    for a, b in zip(shared_out, row_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(shared_grads, row_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_an_empty_completion_scores_in_one_row_per_pair_as_in_a_row_of_the_prompt_alone(examples, smol_tokenizer):
    from dataclasses import replace

    from trainer.data.collators import PairCollator, SharedPromptPairCollator
    from trainer.dpo import sequence_logprobs
    from trainer.reward import pair_rewards

    model = tiny_model(len(smol_tokenizer), "sdpa")
    pad = smol_tokenizer.pad_token_id
    pairs = [replace(examples[0], chosen_ids=[]), replace(examples[1], rejected_ids=[]), *examples[2:]]
    with torch.no_grad():
        shared = SharedPromptPairCollator(pad)(pairs)
        rows = PairCollator(pad)(pairs)
        shared_out = (*pair_rewards(model, shared, "policy"), *sequence_logprobs(model, shared, "policy"))
        row_out = (*pair_rewards(model, rows, "policy"), *sequence_logprobs(model, rows, "policy"))
    for a, b in zip(shared_out, row_out):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert shared_out[2][0] == 0 and shared_out[3][1] == 0  # an empty completion has log-prob 0


def test_flash_attention_falls_back_to_two_rows_per_pair(smol_tokenizer, monkeypatch, caplog):
    from trainer.data.collators import PairCollator, SharedPromptPairCollator, pair_collator

    model = tiny_model(len(smol_tokenizer), "sdpa")
    assert isinstance(pair_collator(0, True, model), SharedPromptPairCollator)
    assert isinstance(pair_collator(0, False, model), PairCollator)
    monkeypatch.setattr(model.causal_lm.config, "_attn_implementation", "flash_attention_2")
    with caplog.at_level("INFO"):
        assert isinstance(pair_collator(0, True, model), PairCollator)
    assert "takes no custom mask" in caplog.text

"""Bring your own data: TRL's plain and conversational preference rows beside hh-rlhf's, and chat templates (the
whole pipeline on a conversational file made with `conversational` below: tests/test_pipeline.py)."""

from __future__ import annotations

import json
import re

import pytest

from foundation.settings import DataArguments
from trainer.data.formats import ChatRenderer, row_parser
from trainer.data.hh_rlhf import DataError, RawRow, load_pairs, parse_row

HH = {"chosen": "\n\nHuman: How do I bake bread?\n\nAssistant: Knead it.\n\nHuman: And then?\n\nAssistant: Bake it "
                "at 220 C.",
      "rejected": "\n\nHuman: How do I bake bread?\n\nAssistant: Knead it.\n\nHuman: And then?\n\nAssistant: No."}


def messages_of(text: str) -> list[dict]:
    """hh-rlhf text as role/content messages."""
    turns = re.split(r"\n\n(Human|Assistant): ?", text)[1:]
    return [{"role": "user" if who == "Human" else "assistant", "content": said} for who, said in zip(turns[::2], turns[1::2])]


def conversational(row: dict, implicit: bool) -> dict:
    chosen, rejected = messages_of(row["chosen"]), messages_of(row["rejected"])
    if implicit:
        return {"chosen": chosen, "rejected": rejected}
    return {"prompt": chosen[:-1], "chosen": chosen[-1:], "rejected": rejected[-1:]}


def parsed(record, data_format="auto", render=None):
    return row_parser(data_format, render)(RawRow("rows.jsonl:1", json.dumps(record)))


@pytest.mark.parametrize("implicit", [False, True])
def test_conversational_rows_without_a_template_read_exactly_as_their_hh_rlhf_text(implicit):
    hh = parse_row(RawRow("rows.jsonl:1", json.dumps(HH)))
    pair = parsed(conversational(HH, implicit), render=ChatRenderer(chat_template="none"))
    assert (pair.prompt, pair.chosen, pair.rejected) == (hh.prompt, hh.chosen, hh.rejected)
    plain = parsed({"prompt": hh.prompt, "chosen": hh.chosen, "rejected": hh.rejected})
    assert (plain.prompt, plain.chosen, plain.rejected) == (hh.prompt, hh.chosen, hh.rejected)


def test_with_smollm2s_chat_template_the_loss_covers_exactly_the_assistant_turn(smol_tokenizer):
    from trainer.data.tokenization import tokenize_sft

    tok = smol_tokenizer
    row = conversational(HH, implicit=False)
    pair = parsed(row, render=ChatRenderer(tok, "auto"))
    assert pair.prompt.endswith("<|im_start|>assistant\n") and pair.chosen == "Bake it at 220 C."
    (example,), _ = tokenize_sft([pair], tok, DataArguments(max_length=512, min_prompt_tokens=4))
    full = tok.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
    # prompt + completion tokens are the whole rendered conversation's tokens, cut where the answer starts
    assert example.prompt_ids + example.completion_ids == tok(full.rstrip(), add_special_tokens=False)["input_ids"]
    trained = [t for t, label in zip(example.input_ids, example.labels) if label != -100]
    assert tok.decode(trained) == "Bake it at 220 C.<|im_end|>"  # the answer and its end of turn, nothing else


def test_prompt_completion_rows_feed_sft_and_ppo_and_are_skipped_by_pairwise_stages(smol_tokenizer):
    from trainer.data.tokenization import tokenize_pairs, tokenize_prompts, tokenize_sft

    plain = parsed({"prompt": "Say hi.", "completion": "Hello!"})
    chat = parsed({"prompt": [{"role": "user", "content": "Say hi."}],
                   "completion": [{"role": "assistant", "content": "Hello!"}]}, render=ChatRenderer(smol_tokenizer))
    assert (plain.prompt, plain.chosen, plain.rejected) == ("Say hi.", "Hello!", None)
    assert chat.prompt.endswith("<|im_start|>assistant\n") and chat.chosen == "Hello!" and chat.rejected is None
    args = DataArguments(max_length=256, min_prompt_tokens=2)
    assert len(tokenize_sft([plain, chat], smol_tokenizer, args)[0]) == 2
    assert len(tokenize_prompts([plain, chat], smol_tokenizer, args)[0]) == 2
    examples, report = tokenize_pairs([plain, chat], smol_tokenizer, args)
    assert examples == [] and report.no_rejected == 2 and "2 without a rejected completion" in report.summary()
    with pytest.raises(DataError, match="rows.jsonl:1: no_rejected"):
        tokenize_pairs([plain], smol_tokenizer, DataArguments(max_length=256, min_prompt_tokens=2, on_bad_row="error"))


def test_text_rows_train_sft_on_every_token_each_in_its_own_split_group(smol_tokenizer, tmp_path):
    from trainer.data.hh_rlhf import split_pairs
    from trainer.data.tokenization import tokenize_pairs, tokenize_prompts, tokenize_sft

    long_text = "Bread is flour, water and salt. " * 40
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["Bread needs yeast.", long_text, "Bake it hot."]))
    pairs, _ = load_pairs(DataArguments(dataset=str(path)), parse=row_parser())
    assert [p.prompt for p in pairs] == ["", "", ""] and pairs[0].chosen == "Bread needs yeast."
    args = DataArguments(dataset=str(path), max_length=32, min_prompt_tokens=4, eval_size=1, sft_size=2,
                         reward_size=0, ppo_size=0)
    assert split_pairs(pairs, args).sizes() == {"eval": 1, "sft": 2, "reward": 0, "ppo": 0}  # one group per text
    examples, report = tokenize_sft(pairs, smol_tokenizer, args)
    assert len(examples) == 3 and report.truncated == 1 and max(e.length for e in examples) == 32
    short = examples[0]
    assert -100 not in short.labels[len(short.prompt_ids):] and short.labels[-1] == smol_tokenizer.eos_token_id
    assert smol_tokenizer.decode(short.completion_ids) == "Bread needs yeast.<|im_end|>"  # every text token trained
    assert tokenize_prompts(pairs, smol_tokenizer, args)[1].no_prompt == 3
    assert tokenize_pairs(pairs, smol_tokenizer, args)[1].no_rejected == 3


def test_bad_rows_of_every_format_are_named_counted_and_refused_under_error(tmp_path):
    rows = [HH, conversational(HH, implicit=True),
            {"prompt": "Hi", "chosen": "Hello", "rejected": 3},  # not_string
            {"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "y"}]},  # no prompt
            {"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "robot", "content": "y"}],
             "rejected": [{"role": "assistant", "content": "z"}]},  # not_messages
            {"chosen": messages_of(HH["chosen"]), "rejected": [{"role": "user", "content": "other"},
                                                               {"role": "assistant", "content": "No."}]}]  # mismatch
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs, report = load_pairs(DataArguments(dataset=str(path)), parse=row_parser("auto", ChatRenderer(None, "none")))
    assert len(pairs) == 2 and report.skipped == {"not_string": 1, "not_messages": 2, "prompt_mismatch": 1}
    pairs, report = load_pairs(DataArguments(dataset=str(path)), parse=row_parser("conversational", ChatRenderer()))
    assert len(pairs) == 1 and report.skipped["wrong_format"] == 2
    with pytest.raises(DataError, match=r"mixed.jsonl:3: not_string: 'rejected' is int"):
        load_pairs(DataArguments(dataset=str(path), on_bad_row="error"), parse=row_parser())

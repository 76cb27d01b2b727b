"""Prompt datasets (jsonl / parquet, verl layout), chat formatting, over-long prompts, the sampler."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_grpo.data.io import load_records, write_records
from megatron_grpo.data.prompts import encode_prompts, render_chat
from megatron_grpo.data.records import PromptRecord, RecordFormat
from megatron_grpo.data.sampler import PromptSampler
from megatron_grpo.data.synthetic import build_tokenizer
from megatron_grpo.errors import CheckpointError, ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]


def _row(i: int, content: str = "hello") -> dict:
    return {"data_source": "test", "prompt": [{"role": "user", "content": f"{content} {i}"}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(i)}, "extra_info": {"index": i}}


def _write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(build_tokenizer(tmp_path_factory.mktemp("tok")))


def test_jsonl_and_parquet_round_trip(tmp_path):
    records = [PromptRecord("test", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2"}],
                            "4", "math", "rule", {"index": 0, "split": "train"}),
               PromptRecord("test", [{"role": "user", "content": "3+3"}], "6", "math", "rule",
                            {"index": 1, "split": "train"})]
    for name in ("d.jsonl", "d.parquet"):
        loaded = load_records(write_records(records, tmp_path / name))
        assert loaded == records
    # the jsonl file is verl's column layout, line by line
    first = json.loads((tmp_path / "d.jsonl").read_text().splitlines()[0])
    assert set(first) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    assert first["reward_model"] == {"style": "rule", "ground_truth": "4"}


def test_prepared_gsm8k_slice_loads(tmp_path):
    import sys
    sys.path.insert(0, str(REPO / "tools"))
    import prepare_gsm8k

    out = tmp_path / "gsm8k.parquet"
    assert prepare_gsm8k.main(["--input", str(REPO / "tests/data/gsm8k_test_slice.jsonl"),
                               "--output", str(out), "--no-progress"]) == 0
    records = load_records(out)
    assert len(records) == 20 and records[0].ground_truth == "18"
    assert records[0].extra_info["split"] == "gsm8k_test_slice" and records[19].extra_info["index"] == 19
    bad = _write_lines(tmp_path / "bad.jsonl", [json.dumps({"question": "q", "answer": "no final line"})])
    assert prepare_gsm8k.main(["--input", str(bad), "--output", str(tmp_path / "x.jsonl")]) == 2


def test_prepare_gsm8k_reports_token_lengths_with_a_tokenizer(tmp_path, tokenizer, capsys):
    """--tokenizer: the prompts' token lengths as the trainer formats them (its chat template) and
    the reference answers', to size data.max_prompt_length / max_response_length."""
    import sys

    sys.path.insert(0, str(REPO / "tools"))
    import prepare_gsm8k

    folder = tmp_path / "tok"
    tokenizer.save_pretrained(folder)
    out = tmp_path / "gsm8k.jsonl"
    assert prepare_gsm8k.main(["--input", str(REPO / "tests/data/gsm8k_test_slice.jsonl"), "--output", str(out),
                               "--no-progress", "--tokenizer", str(folder)]) == 0
    report = capsys.readouterr().out.splitlines()[-1]
    prompts = sorted(len(tokenizer(render_chat(r.prompt, tokenizer, None), add_special_tokens=False)["input_ids"])
                     for r in load_records(out))
    assert report.startswith(f"tokens ({folder}): prompts as the trainer formats them median {prompts[10]}, ")
    assert f"max {prompts[-1]}; reference answers median " in report
    assert prepare_gsm8k.main(["--input", str(REPO / "tests/data/gsm8k_test_slice.jsonl"), "--output", str(out),
                               "--no-progress", "--tokenizer", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize("line, message", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({**_row(0), "data_source": ""}), "'data_source' must be a non-empty string"),
    (json.dumps({**_row(0), "prompt": "just text"}), "'prompt' must be a non-empty list"),
    (json.dumps({**_row(0), "prompt": [{"role": "robot", "content": "x"}]}), "prompt[0].role must be one of"),
    (json.dumps({**_row(0), "prompt": [{"role": "user", "content": 5}]}), "prompt[0].content must be a string"),
    (json.dumps({**_row(0), "reward_model": {"style": "rule"}}),
     "'reward_model' must be an object with 'ground_truth'"),
    (json.dumps({**_row(0), "extra_info": [1]}), "'extra_info' must be an object"),
])
def test_bad_line_names_file_and_line(tmp_path, line, message):
    # line 1 and 2 are good, line 3 is blank (skipped), line 4 is the bad one
    path = _write_lines(tmp_path / "data.jsonl", [json.dumps(_row(0)), json.dumps(_row(1)), "", line])
    with pytest.raises(DataError) as info:
        load_records(path)
    assert str(info.value).startswith(f"{path}:4: ")
    assert message in str(info.value)


def test_bad_parquet_row_and_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(0), {**_row(1), "data_source": None}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet:row 2: 'data_source'"):
        load_records(tmp_path / "d.parquet")
    with pytest.raises(DataError, match="does not exist"):
        load_records(tmp_path / "absent.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unknown dataset format"):
        load_records(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")


def test_chat_formatting_tokenizer_template_and_template_string(tokenizer):
    messages = [{"role": "system", "content": "sort"}, {"role": "user", "content": "reverse 123"}]
    text = render_chat(messages, tokenizer)
    assert text == ("<|im_start|>system\nsort<|im_end|>\n<|im_start|>user\nreverse 123<|im_end|>\n"
                    "<|im_start|>assistant\n")
    custom = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    assert render_chat(messages, tokenizer, custom) == "system: sort\nuser: reverse 123\nassistant:"


def test_overlong_prompts_filtered_truncated_or_rejected(tokenizer, caplog):
    records = [PromptRecord("t", [{"role": "user", "content": "copy " + "1" * n}], "1") for n in (1, 5, 12)]
    # "<|im_start|>user\ncopy " + n digits + "<|im_end|>\n<|im_start|>assistant\n": 5 + n + 5 tokens
    lengths = [len(tokenizer(render_chat(r.prompt, tokenizer), add_special_tokens=False).input_ids) for r in records]
    assert lengths == [11, 15, 22]
    kept, stats = encode_prompts(records, tokenizer, max_prompt_length=15, overlong="filter", source="toy")
    assert [k.record for k in kept] == records[:2] and (stats.filtered, stats.truncated) == (1, 0)
    assert "toy: 1 of 3 prompts are longer than 15 tokens: 1 filtered out" in caplog.text
    assert kept[1].input_ids == tokenizer(kept[1].text, add_special_tokens=False).input_ids

    kept, stats = encode_prompts(records, tokenizer, max_prompt_length=15, overlong="truncate_left")
    full = tokenizer(kept[2].text, add_special_tokens=False).input_ids
    assert stats.truncated == 1 and kept[2].truncated and kept[2].input_ids == full[-15:]
    kept, _ = encode_prompts(records, tokenizer, max_prompt_length=15, overlong="truncate_right")
    assert kept[2].input_ids == full[:15]
    with pytest.raises(DataError, match="toy: record 3 has a 22-token prompt"):
        encode_prompts(records, tokenizer, max_prompt_length=15, overlong="error", source="toy")
    with pytest.raises(ConfigError, match="overlong_prompts"):
        encode_prompts(records, tokenizer, max_prompt_length=15, overlong="drop")


def test_sampler_epochs_cover_every_item_in_a_new_order():
    items = list(range(10))
    sampler = PromptSampler(items, batch_size=3, seed=7)
    assert sampler.batches_per_epoch == 3
    epochs = [[x for _ in range(3) for x in next(sampler)] for _ in range(4)]
    for epoch in epochs:
        assert len(set(epoch)) == 9  # drop_last: one item per epoch is skipped, none repeats
    assert len({tuple(e) for e in epochs}) == 4
    assert sampler.epoch == 3
    # same seed, same sequence; another seed, another one
    again = PromptSampler(items, batch_size=3, seed=7)
    assert [x for _ in range(12) for x in next(again)] == [x for e in epochs for x in e]
    other = PromptSampler(items, batch_size=3, seed=8)
    assert [x for _ in range(3) for x in next(other)] != epochs[0]
    # no shuffle, keep the last partial batch, stop after max_epochs
    plain = PromptSampler(items, batch_size=4, seed=0, shuffle=False, drop_last=False, max_epochs=2)
    assert list(plain) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] * 2


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_sampler_resume_matches_uninterrupted_run(stop_after):
    items = [f"prompt {i}" for i in range(11)]
    uninterrupted = PromptSampler(items, batch_size=4, seed=3)
    expected = [next(uninterrupted) for _ in range(10)]

    first = PromptSampler(items, batch_size=4, seed=3)
    seen = [next(first) for _ in range(stop_after)]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as JSON
    resumed = PromptSampler(items, batch_size=4, seed=3)
    resumed.load_state_dict(state)
    seen += [next(resumed) for _ in range(10 - stop_after)]
    assert seen == expected


def test_sampler_rejects_mismatched_state_and_bad_settings():
    sampler = PromptSampler(list(range(10)), batch_size=2, seed=1)
    next(sampler)
    with pytest.raises(CheckpointError, match="num_items was 10 when saved, is 9 now"):
        PromptSampler(list(range(9)), batch_size=2, seed=1).load_state_dict(sampler.state_dict())
    with pytest.raises(CheckpointError, match="seed"):
        PromptSampler(list(range(10)), batch_size=2, seed=2).load_state_dict(sampler.state_dict())
    with pytest.raises(ConfigError, match="fewer than one batch"):
        PromptSampler(list(range(3)), batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        PromptSampler(list(range(3)), batch_size=0, seed=0)


def test_a_latin1_byte_names_the_file_line_and_byte(tmp_path):
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(_row(0)).encode()
    bad = json.dumps(_row(1, content="caf\u00e9"), ensure_ascii=False).encode("latin-1")
    path.write_bytes(good + b"\n" + bad + b"\n")
    with pytest.raises(DataError) as info:
        load_records(path)
    column = bad.index(b"\xe9") + 1
    assert str(info.value) == (f"{path}:2: not UTF-8 (byte 0xe9 at byte {column} of the line); JSON Lines files "
                               "are UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8)")


@pytest.mark.parametrize("answer", [["18"], {"value": "18"}, True])
def test_a_non_scalar_ground_truth_is_refused_for_the_built_in_scorers(tmp_path, answer):
    """Our gsm8k scorer (as verl's) compares the answer with str(ground_truth): ["18"] would score
    every correct response 0. A user function gets the value as the file has it."""
    from megatron_grpo.rewards.gsm8k import reward

    assert reward("", "#### 18", ["18"]) == 0.0 and reward("", "#### 18", 18) == 1.0  # why it is refused
    line = json.dumps({**_row(0), "reward_model": {"style": "rule", "ground_truth": answer}})
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(_row(1)), line])
    with pytest.raises(DataError) as info:
        load_records(path, RecordFormat(scalar_ground_truth_for="gsm8k"))
    assert str(info.value).startswith(f"{path}:2: reward_model.ground_truth is {json.dumps(answer)} "
                                      f"({type(answer).__name__}); the gsm8k scorer compares one answer")
    assert load_records(path)[1].ground_truth == answer  # no scorer named: kept for the user's function
    number = _write_lines(tmp_path / "n.jsonl", [json.dumps({**_row(0), "reward_model": {"ground_truth": 18}})])
    assert [r.ground_truth for r in load_records(number, RecordFormat(scalar_ground_truth_for="gsm8k"))] == [18]


def _with_answer(i: int, answer, data_source: str = "test") -> dict:
    return {**_row(i), "data_source": data_source, "reward_model": {"style": "rule", "ground_truth": answer}}


def test_float_and_padded_ground_truths_reach_the_built_in_scorers_as_verls_strings(tmp_path):
    """A pandas / parquet float column holds the answer 72 as 72.0, and str(72.0) = "72.0" never
    equals the "72" that gsm8k (as verl's) extracts from "#### 72"; " 72 " neither. Loaded for a
    built-in scorer they become "72"; a non-integral number stays as it is (gsm8k matches 72.5);
    a user's function gets the value as the file has it."""
    from megatron_grpo.rewards.gsm8k import reward

    assert reward("", "#### 72", 72.0) == 0.0 and reward("", "#### 72", " 72 ") == 0.0  # why they are normalised
    gsm8k = RecordFormat(scalar_ground_truth_for="gsm8k")
    answers = [72.0, " 72 ", "\t72\n", 72.5, 18, -3.0]
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(_with_answer(i, a)) for i, a in enumerate(answers)])
    loaded = [r.ground_truth for r in load_records(path, gsm8k)]
    assert loaded == ["72", "72", "72", 72.5, 18, "-3"]
    assert [reward("", f"#### {a}", gt) for a, gt in zip(["72", "72", "72", "72.5", "18", "-3"], loaded)] == [1.0] * 6
    assert [r.ground_truth for r in load_records(path)] == answers  # no built-in scorer: as in the file
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist([_with_answer(0, 72.0), _with_answer(1, 72.5)])
    assert table.schema.field("reward_model").type.field("ground_truth").type == pa.float64()
    pq.write_table(table, tmp_path / "d.parquet")
    assert [r.ground_truth for r in load_records(tmp_path / "d.parquet", gsm8k)] == ["72", 72.5]


@pytest.mark.parametrize("answer, scorer, problem", [
    ("", "math", "it is empty or whitespace only"),
    (" \t ", "gsm8k", "it is empty or whitespace only"),
    (float("nan"), "math", "it is NaN: a float column's missing value"),
    ("1,000", "gsm8k", "it compares the ground truth, as text, with the number it extracts"),
    ("$18", "gsm8k", "it compares the ground truth, as text"),
    (1e-07, "gsm8k", "it compares the ground truth, as text"),  # str(1e-07) is "1e-07"
])
def test_a_ground_truth_the_built_in_scorer_can_never_match_is_refused_at_its_line(tmp_path, answer, scorer,
                                                                                    problem):
    """Refused at load instead of scoring every response 0 for the whole run: what no response
    can match (gsm8k compares the text of the number it extracts; an empty or NaN answer for any
    one-answer scorer). What the scorer can match loads (gsm8k: "1000", "-0.5"; math: "1,000")."""
    import functools

    from megatron_grpo.rewards.answers import ground_truth_problem

    def fmt(name):
        return RecordFormat(scalar_ground_truth_for=name, ground_truth_problem=functools.partial(
            ground_truth_problem, name))

    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(_with_answer(0, "7")), json.dumps(_with_answer(1, answer))])
    with pytest.raises(DataError) as info:
        load_records(path, fmt(scorer))
    assert str(info.value).startswith(f"{path}:2: reward_model.ground_truth is {json.dumps(answer)} "
                                      f"({type(answer).__name__}): the {scorer} scorer can never score a response "
                                      f"correct against it ({problem}")
    assert str(info.value).endswith("); fix the answer, or set reward.function to a function of yours")
    ok = _write_lines(tmp_path / "ok.jsonl", [json.dumps(_with_answer(i, a)) for i, a in enumerate(["1000", "-0.5"])])
    assert [r.ground_truth for r in load_records(ok, fmt("gsm8k"))] == ["1000", "-0.5"]
    comma = _write_lines(tmp_path / "comma.jsonl", [json.dumps(_with_answer(0, "1,000"))])
    assert [r.ground_truth for r in load_records(comma, fmt("math"))] == ["1,000"]


def test_the_trainer_checks_ground_truths_for_its_built_in_scorer(tmp_path, tokenizer):
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts

    line = json.dumps({**_row(0), "reward_model": {"style": "rule", "ground_truth": ["18"]}})
    path = _write_lines(tmp_path / "d.jsonl", [line])
    overrides = [f"data.train_files=[{path}]", "data.task=null", "data.val_files=[]"]
    with pytest.raises(DataError, match=r"d\.jsonl:1: reward_model\.ground_truth is \[\"18\"\]"):
        load_prompts(load_config("tiny_cpu", [*overrides, "reward.function=math"]), tokenizer)
    user_function = f"reward.function={REPO}/tests/data/user_rewards.py:length_match"
    train, _ = load_prompts(load_config("tiny_cpu", [*overrides, user_function]), tokenizer)
    assert len(train) == 1
    # and reads the messages from data.prompt_key
    row = {**_row(3)}
    row["chat"] = row.pop("prompt")
    renamed = _write_lines(tmp_path / "renamed.jsonl", [json.dumps(row)])
    train, _ = load_prompts(load_config("tiny_cpu", ["data.task=null", f"data.train_files={renamed}",
                                                     "data.prompt_key=chat"]), tokenizer)
    assert [p.record.prompt for p in train] == [[{"role": "user", "content": "hello 3"}]]


def test_the_trainer_refuses_a_ground_truth_its_scorer_cannot_match_by_the_rows_data_source(tmp_path, tokenizer):
    """reward.function=gsm8k checks every row; by_data_source only the rows it scores with gsm8k;
    nothing is checked where reward.function does not score the rows."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts

    rows = [_with_answer(0, 72.0, "openai/gsm8k"), _with_answer(1, "1,000", "lighteval/MATH"),
            _with_answer(2, "1,000", "openai/gsm8k")]
    every_row = _write_lines(tmp_path / "d.jsonl", [json.dumps(row) for row in rows])
    first_two = _write_lines(tmp_path / "first_two.jsonl", [json.dumps(row) for row in rows[:2]])

    def prompts(function, data, *more):
        overrides = ["data.task=null", "data.val_files=[]", f"data.train_files=[{data}]", f"reward.function={function}"]
        return load_prompts(load_config("tiny_cpu", [*overrides, *more]), tokenizer)[0]

    for function, line in (("gsm8k", 2), ("by_data_source", 3)):  # by_data_source scores row 2 with math
        with pytest.raises(DataError, match=rf"d\.jsonl:{line}: reward_model\.ground_truth is \"1,000\" \(str\): "
                                            rf"the {function} scorer can never score"):
            prompts(function, every_row)
    assert [p.record.ground_truth for p in prompts("by_data_source", first_two)] == ["72", "1,000"]
    # with an environment, it scores the rows (reward.function, gsm8k by default, does not): as in the file
    episodes = prompts("gsm8k", every_row, "rollout.multi_turn.environment=lookup")
    assert [p.record.ground_truth for p in episodes] == [72.0, "1,000", "1,000"]


@pytest.mark.parametrize("messages, which", [
    ([{"role": "user", "content": ""}], "user message"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": " \n\t"}], "user message"),
    ([{"role": "system", "content": "  "}], "message"),
])
def test_a_prompt_that_asks_nothing_is_refused_at_its_line_or_row(tmp_path, messages, which):
    """An empty or whitespace-only prompt (e.g. a column mapped wrongly) trained on silently: now
    the file and line (parquet: row) name it. An empty system message beside a question is kept
    (it keeps some chat templates from adding their default system prompt)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    bad = {**_row(1), "prompt": messages}
    expected = f"'prompt' asks nothing: every {which}'s content is empty or whitespace only"
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(_row(0)), json.dumps(bad)])
    with pytest.raises(DataError) as info:
        load_records(path)
    assert str(info.value) == f"{path}:2: {expected}"
    pq.write_table(pa.Table.from_pylist([_row(0), bad]), tmp_path / "d.parquet")
    with pytest.raises(DataError) as info:
        load_records(tmp_path / "d.parquet")
    assert str(info.value) == f"{tmp_path / 'd.parquet'}:row 2: {expected}"
    kept = {**_row(2), "prompt": [{"role": "system", "content": ""}, {"role": "user", "content": "2+2"}]}
    assert load_records(_write_lines(tmp_path / "ok.jsonl", [json.dumps(kept)]))[0].prompt == kept["prompt"]


def test_prompt_key_names_the_column_of_the_chat_messages(tmp_path):
    """verl's data.prompt_key: the messages may sit under any column name."""
    row = {**_row(0)}
    row["question_chat"] = row.pop("prompt")
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(row)])
    [record] = load_records(path, RecordFormat(prompt_key="question_chat"))
    assert record.prompt == [{"role": "user", "content": "hello 0"}]
    with pytest.raises(DataError) as info:
        load_records(path)  # the default column, "prompt", is not in this file
    assert str(info.value) == (f"{path}:1: 'prompt' must be a non-empty list of chat messages {{role, content}}; "
                               "the row's keys: data_source, ability, reward_model, extra_info, question_chat")
    with pytest.raises(DataError, match=r"'chat' \(data.prompt_key\) must be a non-empty list"):
        load_records(path, RecordFormat(prompt_key="chat"))


def test_reward_fn_key_names_the_column_read_as_data_source(tmp_path, tokenizer):
    """verl's data.reward_fn_key: the column whose value picks the scorer (the reward function's
    data_source); the trainer reads it from the recipe, and a row without it is named."""
    from megatron_grpo.config import load_config
    from megatron_grpo.trainer.assembly.prompt_data import load_prompts

    row = {**_row(0), "task_family": "openai/gsm8k"}
    row.pop("data_source")
    path = _write_lines(tmp_path / "d.jsonl", [json.dumps(row)])
    [record] = load_records(path, RecordFormat(reward_fn_key="task_family"))
    assert record.data_source == "openai/gsm8k"
    with pytest.raises(DataError) as info:
        load_records(path)
    assert str(info.value).startswith(f"{path}:1: 'data_source' must be a non-empty string; the row's keys: ")
    with pytest.raises(DataError, match=r"'source' \(data.reward_fn_key\) must be a non-empty string"):
        load_records(path, RecordFormat(reward_fn_key="source"))
    train, _ = load_prompts(load_config("tiny_cpu", ["data.task=null", f"data.train_files={path}",
                                                     "data.reward_fn_key=task_family"]), tokenizer)
    assert [p.record.data_source for p in train] == ["openai/gsm8k"]

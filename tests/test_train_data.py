"""EAGLE-3 training data: the assistant-only loss mask for several chat templates, self-distilled data generation
(batched, resumable, same tokens as plain greedy decoding), and clear errors for bad input."""

from __future__ import annotations

import json
import string
from pathlib import Path

import pytest
import torch

from eagle.traineagle3 import gen_data
from eagle.traineagle3.chat import ChatTemplateError, end_of_turn_ids, normalize_conversation, tokenize_conversation
from eagle.traineagle3.data import ConversationDataset
from eagle.traineagle3.batch_generation import generate_batch
from eagle.traineagle3.prompts import read_json_records

CHATML = (
    "{% if messages[0]['role'] == 'system' %}{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{% if not (message['role'] == 'system' and loop.first) %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
ZEPHYR = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else "
    "message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

TEMPLATES = {
    # name: (template, special tokens, bos, eos, masked text of each assistant turn)
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>"], None, "<|im_end|>",
               ["Hello there! <|im_end|>", "Sure.<|im_end|>"]),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", ["Hello there!<|eot_id|>", "Sure.<|eot_id|>"]),
    "zephyr": (ZEPHYR, ["<|user|>", "<|assistant|>", "<|system|>", "</s>"], None, "</s>",
               ["Hello there! </s>", "Sure.</s>"]),
    "gemma": (GEMMA, ["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], "<bos>", "<eos>",
              ["Hello there!<end_of_turn>", "Sure.<end_of_turn>"]),
}
CONVERSATION = {
    "conversations": [
        {"from": "human", "value": "Hi, who are you?"},
        {"from": "gpt", "value": "Hello there! "},
        {"from": "human", "value": "Say yes."},
        {"from": "gpt", "value": "Sure."},
    ]
}


def char_tokenizer(template: str, specials: list[str], bos: str | None, eos: str):
    """One token per character, plus the template's special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(["<unk>", *specials, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token=bos, eos_token=eos,
                                        additional_special_tokens=specials)
    tokenizer.chat_template = template
    return tokenizer


def masked_runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    """The contiguous masked stretches, as text (one token per character or special token)."""
    runs, current = [], []
    for token, flag in zip(tokenizer.convert_ids_to_tokens(ids), mask):
        if flag:
            current.append(token)
        elif current:
            runs.append("".join(current))
            current = []
    if current:
        runs.append("".join(current))
    return runs


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_loss_mask_covers_exactly_the_assistant_answers_and_their_end_token(name):
    template, specials, bos, eos, expected = TEMPLATES[name]
    tokenizer = char_tokenizer(template, specials, bos, eos)
    tokenized = tokenize_conversation(tokenizer, normalize_conversation(CONVERSATION))
    assert tokenizer.decode(tokenized.input_ids) == tokenizer.apply_chat_template(
        normalize_conversation(CONVERSATION), tokenize=False
    )
    assert masked_runs(tokenizer, tokenized.input_ids, tokenized.loss_mask) == expected
    assert sum(tokenized.loss_mask) == sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in expected)
    # The end-of-turn token the template writes after an answer is one that generation stops at.
    end_tokens = tokenizer.convert_ids_to_tokens(end_of_turn_ids(tokenizer))
    assert any(expected[0].endswith(token) for token in end_tokens)


def test_template_that_rewrites_earlier_turns_is_refused():
    rewriting = "{% for message in messages %}{{ message['role'] + ':' + message['content'] + '|' + (messages|length|string) }}{% endfor %}"
    tokenizer = char_tokenizer(rewriting, ["<eos>"], None, "<eos>")
    with pytest.raises(ChatTemplateError, match="prefix"):
        tokenize_conversation(tokenizer, normalize_conversation(CONVERSATION))


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_dataset_counts_skips_and_refuses_a_missing_chat_template(tmp_path):
    template, specials, bos, eos, _ = TEMPLATES["chatml"]
    tokenizer = char_tokenizer(template, specials, bos, eos)
    long_answer = {"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y" * 500}]}
    no_answer = {"conversations": [{"from": "human", "value": "only a question"}]}
    malformed = {"text": "not a conversation"}
    path = write_jsonl(tmp_path / "data.jsonl", [CONVERSATION, long_answer, no_answer, malformed])
    dataset = ConversationDataset(str(path), tokenizer, max_len=200)
    report = dataset.report
    assert (report.records, report.kept, report.too_long, report.no_assistant, report.malformed) == (4, 1, 1, 1, 1)
    assert "1 longer than --max_len" in report.summary()

    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ConversationDataset(str(path), tokenizer, max_len=200)


def test_read_json_records_accepts_a_list_or_jsonl_and_says_what_is_wrong(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"a": 1}, {"a": 2}]))
    (tmp_path / "b.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n')
    (tmp_path / "c.jsonl").write_text('{"a": 1}\n{broken\n')
    assert read_json_records(str(tmp_path / "a.json")) == read_json_records(str(tmp_path / "b.jsonl"))
    with pytest.raises(ValueError, match="line 2"):
        read_json_records(str(tmp_path / "c.jsonl"))
    with pytest.raises(FileNotFoundError):
        read_json_records(str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from tiny_models import make_target

    directory = tmp_path_factory.mktemp("target")
    model = make_target(directory, "llama")
    return directory, model


def test_batched_generation_matches_plain_greedy_decoding(tiny_target):
    from transformers import AutoTokenizer

    directory, model = tiny_target
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        for text in ["Hi", "A much longer question about the weather today?", "Why?"]
    ]
    stops = end_of_turn_ids(tokenizer)
    assert stops == [tokenizer.convert_tokens_to_ids("<|im_end|>")]  # ChatML's end of turn, written out
    outs = generate_batch(model, tokenizer, prompts, max_new_tokens=12, stop_ids=stops)
    for prompt, out in zip(prompts, outs):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        reference = model.generate(ids, max_new_tokens=12, do_sample=False,
                                   eos_token_id=[tokenizer.convert_tokens_to_ids("<|im_end|>")], pad_token_id=0)
        reference = reference[0, ids.shape[1]:].tolist()
        finished = bool(reference) and reference[-1] in stops
        assert out.token_ids == (reference[:-1] if finished else reference)
        assert out.finished == finished


def test_gen_data_writes_sharegpt_records_and_resumes(tiny_target, tmp_path, capsys):
    directory, model = tiny_target
    questions = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 1, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
        {"question_id": 2, "category": "math", "turns": ["What is 1+1?"]},
    ])
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"id": "s1", "conversations": [
        {"from": "human", "value": "Hello"}, {"from": "gpt", "value": "old answer, discarded"}]}]))
    out = tmp_path / "out" / "data.jsonl"
    common = ["--basepath", str(directory), "--output", str(out), "--turns", "2", "--max-new-tokens", "6",
              "--batch-size", "2", "--prompt-max-tokens", "8", "--questions", str(questions), "--sharegpt", str(sharegpt)]
    assert gen_data.main(common + ["--synthesize", "3"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_id = {record["id"]: record for record in records}
    assert {"question-1", "question-2", "sharegpt-s1"} <= set(by_id)
    assert [turn["from"] for turn in by_id["question-1"]["conversations"]] == ["human", "gpt", "human", "gpt"]
    assert by_id["question-1"]["conversations"][2]["value"] == "Shorter."
    assert len(by_id["question-2"]["conversations"]) == 2
    assert by_id["sharegpt-s1"]["conversations"][1]["value"] != "old answer, discarded"
    synthesized = [record for record in records if record["source"] == "synthesized"]
    assert synthesized and all(record["conversations"][0]["from"] == "human" for record in synthesized)
    assert all(len(record["finished"]) == len(record["conversations"]) // 2 for record in records)

    # The answer is the model's own greedy continuation of the rendered prompt.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 1+1?"}], tokenize=False,
                                           add_generation_prompt=True)
    # (computed by transformers' own greedy generate, not by the batched generation gen_data uses)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")  # ChatML's end of turn
    expected = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=[end], pad_token_id=0)[0, ids.shape[1]:]
    assert by_id["question-2"]["conversations"][1]["value"] == tokenizer.decode(expected, skip_special_tokens=True)

    # Resuming: nothing is redone; asking for more synthesized prompts adds only the new ones.
    before = out.read_text()
    assert gen_data.main(common + ["--synthesize", "3"]) == 0
    assert out.read_text() == before
    assert gen_data.main(common + ["--synthesize", "4"]) == 0
    assert out.read_text().startswith(before)
    assert len(out.read_text().splitlines()) <= len(before.splitlines()) + 1


def test_gen_data_time_budget_stops_between_batches_and_a_rerun_continues(tiny_target, tmp_path, capsys):
    """``--time-budget``: a spent budget starts no further batch (the first always runs), every started batch is
    written whole, and a rerun with the same flags picks up the rest."""
    directory, _ = tiny_target
    out = tmp_path / "data.jsonl"
    common = ["--basepath", str(directory), "--output", str(out), "--turns", "1", "--max-new-tokens", "4",
              "--batch-size", "3", "--prompt-max-tokens", "8", "--synthesize", "9"]
    assert gen_data.main(common + ["--time-budget", "0.00001"]) == 0
    assert "--time-budget 1e-05 min: stopped after 1 batches" in capsys.readouterr().out
    first = out.read_text().splitlines()
    assert 1 <= len(first) <= 3
    assert gen_data.main(common) == 0
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert ids[: len(first)] == [json.loads(line)["id"] for line in first] and len(ids) == len(set(ids)) > len(first)


def test_gen_data_without_prompts_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="No prompts"):
        gen_data.main(["--basepath", str(tmp_path), "--output", str(tmp_path / "o.jsonl")])


def test_vocab_map_cache_is_keyed_by_data_tokenizer_and_size(tmp_path):
    from eagle.traineagle3.data import load_or_build_vocab_map, vocab_map_cache_path

    template, specials, bos, eos, _ = TEMPLATES["chatml"]
    tokenizer = char_tokenizer(template, specials, bos, eos)
    first = write_jsonl(tmp_path / "a.jsonl", [CONVERSATION])
    second = write_jsonl(tmp_path / "b.jsonl", [CONVERSATION, CONVERSATION])
    cache = tmp_path / "cache"
    paths = {
        vocab_map_cache_path(str(cache), str(first), tokenizer, len(tokenizer), 16, 100),
        vocab_map_cache_path(str(cache), str(second), tokenizer, len(tokenizer), 16, 100),
        vocab_map_cache_path(str(cache), str(first), tokenizer, len(tokenizer), 17, 100),
    }
    other = char_tokenizer(LLAMA3, TEMPLATES["llama3"][1], "<|begin_of_text|>", "<|eot_id|>")
    paths.add(vocab_map_cache_path(str(cache), str(first), other, len(tokenizer), 16, 100))
    assert len(paths) == 4 and all(str(cache) in path for path in paths)

    dataset = ConversationDataset(str(first), tokenizer, max_len=100)
    d2t, t2d = load_or_build_vocab_map(dataset, tokenizer, len(tokenizer), 16, 100, str(cache))
    assert len(list(cache.iterdir())) == 1
    again_d2t, again_t2d = load_or_build_vocab_map(dataset, tokenizer, len(tokenizer), 16, 100, str(cache))
    assert torch.equal(d2t, again_d2t) and torch.equal(t2d, again_t2d) and len(list(cache.iterdir())) == 1


def test_gguf_base_paths_resolve_to_a_directory_and_file(tmp_path):
    from eagle.model.base.loading import split_gguf_path  # the trainer loads --basepath through it too

    one = tmp_path / "one"
    one.mkdir()
    (one / "model.Q4.gguf").write_bytes(b"")
    assert split_gguf_path(str(one)) == (str(one), "model.Q4.gguf")
    assert split_gguf_path(str(one / "model.Q4.gguf")) == (str(one), "model.Q4.gguf")
    (one / "other.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf"):
        split_gguf_path(str(one))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="neither a config.json nor a .gguf"):
        split_gguf_path(str(empty))
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    assert split_gguf_path(str(hf_dir)) == (str(hf_dir), None)


def test_cached_target_outputs_survive_a_restart(tiny_target, tmp_path):
    """--cache_target: a second run (a restart) reads the target's outputs from disk without running the target,
    and gets what the first run trained on: the same features (float16) and top-k distribution."""
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig
    from eagle.traineagle3.data import Sample, collate
    from eagle.traineagle3.target_outputs import TargetOutputs

    directory, model = tiny_target
    config = EConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, draft_vocab_size=32)
    head = Model(config)
    used = torch.arange(0, 128, 4)
    head.d2t.copy_(used - torch.arange(32))
    head.t2d[used] = True
    batch = collate([Sample(torch.randint(6, 100, (9,)), torch.ones(9, dtype=torch.long), 0),
                     Sample(torch.randint(6, 100, (5,)), torch.ones(5, dtype=torch.long), 1)])
    first = TargetOutputs(model, head, [2, 3, 3], cache_top_k=4, cache_dir=str(tmp_path / "cache"))
    features, probs, in_draft = first(batch, "cpu")
    assert features.shape == (2, 9, 192) and probs.shape == (2, 9, 32) and in_draft.shape == (2, 9)
    assert torch.allclose(probs[0].sum(-1), torch.ones(9), atol=1e-2) and int((probs[0] > 0).sum(-1).max()) <= 4
    restarted = TargetOutputs(None, head, [2, 3, 3], cache_top_k=4, cache_dir=str(tmp_path / "cache"))
    again = restarted(batch, "cpu")  # would fail if it tried to run the (absent) target
    for before, after in zip((features, probs, in_draft), again):
        assert torch.equal(before, after)


def test_gen_data_shards_cover_every_prompt_once(tiny_target, tmp_path, capsys):
    """``--shard I/N`` on N machines: disjoint outputs that together answer every prompt; a bad share is refused."""
    directory, _ = tiny_target
    questions = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": i, "category": "writing", "turns": [f"Question number {i}?"]} for i in range(5)])
    common = ["--basepath", str(directory), "--turns", "1", "--max-new-tokens", "3", "--batch-size", "4",
              "--questions", str(questions)]
    ids = []
    for shard in ("0/2", "1/2"):
        out = tmp_path / f"part{shard[0]}.jsonl"
        assert gen_data.main(common + ["--output", str(out), "--shard", shard]) == 0
        ids.append([json.loads(line)["id"] for line in out.read_text().splitlines()])
    assert len(ids[0]) == 3 and len(ids[1]) == 2 and not set(ids[0]) & set(ids[1])
    assert set(ids[0]) | set(ids[1]) == {f"question-{i}" for i in range(5)}
    for bad in ("2/2", "1", "a/b"):
        with pytest.raises(SystemExit):
            gen_data.main(common + ["--output", str(tmp_path / "x.jsonl"), "--shard", bad])
    assert "expected" in capsys.readouterr().err

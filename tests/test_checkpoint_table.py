"""docs/CHECKPOINTS.md's "Published checkpoints" table stays true: it lists every checkpoint pair of the EAGLE README's two
tables, every family and head layout it names is one the tests can build, and a tiny model of each family, with a
random head in each layout the table gives it, is lossless: greedy EAGLE output equals the reference greedy decoding
for each prompt alone and for each row of a left-padded batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.model import EaModel
from head_layouts import LAYOUTS, Semantics, publish
from test_batching import left_padded
from tiny_models import CHECKPOINT_FAMILIES, FAMILIES, make_head, make_remote_target, make_target

TABLE_DOC = Path(__file__).resolve().parents[1] / "docs" / "CHECKPOINTS.md"
SECTION = "# Published checkpoints"
# The heads of the EAGLE README's "EAGLE-3 Models on Hugging Face" and "EAGLE Models on Hugging Face" tables
# (SafeAILab/EAGLE at commit cb7e084).
EAGLE_README_HEADS = {
    "yuhuili/EAGLE3-Vicuna1.3-13B", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B",
    "yuhuili/EAGLE3-DeepSeek-R1-Distill-LLaMA-8B", "lmsys/sglang-EAGLE3-Llama-4-Scout-17B-16E-Instruct-v1",
    "lmsys/sglang-EAGLE3-Llama-4-Maverick-17B-128E-Instruct-v1", "nvidia/Llama-4-Maverick-17B-128E-Eagle3",
    "AngelSlim/Qwen3-1.7B_eagle3", "AngelSlim/Qwen3-4B_eagle3", "Tengyunw/qwen3_8b_eagle3",
    "AngelSlim/Qwen3-8B_eagle3", "Zjcxy-SmartAI/Eagle3-Qwen3-8B-zh", "AngelSlim/Qwen3-14B_eagle3",
    "Tengyunw/qwen3_30b_moe_eagle3", "AngelSlim/Qwen3-a3B_eagle3", "AngelSlim/Qwen3-32B_eagle3",
    "Zjcxy-SmartAI/Eagle3-Qwen3-32B-zh", "nvidia/Qwen3-235B-A22B-Eagle3", "lmsys/Qwen3-235B-A22B-EAGLE3",
    "linglingdan/Eagle3_for_MiniCPM4", "wantsleep/OLMoE_1B_7B_Eagle3", "wantsleep/granite-3.1-1b-a400m-EAGLE3",
    "lmsys/EAGLE3-gpt-oss-120b-bf16", "nvidia/gpt-oss-120b-Eagle3", "thoughtworks/GLM-4.7-Flash-Eagle3",
    "yuhuili/EAGLE-Vicuna-7B-v1.3", "yuhuili/EAGLE-Vicuna-13B-v1.3", "yuhuili/EAGLE-Vicuna-33B-v1.3",
    "yuhuili/EAGLE-llama2-chat-7B", "yuhuili/EAGLE-llama2-chat-13B", "yuhuili/EAGLE-llama2-chat-70B",
    "yuhuili/EAGLE-mixtral-instruct-8x7B", "yuhuili/EAGLE-LLaMA3-Instruct-8B", "yuhuili/EAGLE-LLaMA3-Instruct-70B",
    "yuhuili/EAGLE-Qwen2-7B-Instruct", "yuhuili/EAGLE-Qwen2-72B-Instruct", "yuhuili/EAGLE-LLaMA3.1-Instruct-8B",
    "Zjcxy-SmartAI/Eagle-Qwen2.5-14B-Instruct",
}
KNOWN_FAMILIES = set(CHECKPOINT_FAMILIES) | set(FAMILIES) | {"minicpm"}
# Prompts longer than every tiny family's boundaries (8-token chunks and windows, temperature steps every 4), one
# short; with the new tokens each row crosses several of them.
PROMPTS = [[1] + list(range(40, 60)), [1, 70, 71], [1] + list(range(80, 92))]
MAX_NEW = 16


def table_rows() -> list[dict[str, str]]:
    """The rows of docs/CHECKPOINTS.md's "Published checkpoints" table, as {column: cell}."""
    text = TABLE_DOC.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    end = section.find("\n#", len(SECTION))
    section = section if end < 0 else section[:end]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]


def family_and_layout(row: dict[str, str]) -> tuple[str, str]:
    return row["Family"].strip("`"), row["Head layout"].replace(" (assumed)", "")


PAIRS = sorted({family_and_layout(row) for row in table_rows()})


def test_the_table_lists_every_checkpoint_of_the_eagle_readme():
    heads = [row["Head"] for row in table_rows()]
    assert len(heads) == len(set(heads)) and set(heads) == EAGLE_README_HEADS


def test_every_family_and_layout_of_the_table_is_built_by_the_tests():
    assert PAIRS and {family for family, _ in PAIRS} <= KNOWN_FAMILIES
    assert {layout for _, layout in PAIRS} <= set(LAYOUTS)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (directory, model), built once per module."""
    root, built = tmp_path_factory.mktemp("table"), {}

    def get(family):
        if family not in built:
            directory = root / family
            model = (make_remote_target(directory, seed=3) if family == "minicpm"
                     else make_target(directory, family, seed=3, layers=4))
            built[family] = (directory, model)
        return built[family]

    return get


def write_head(directory: Path, model, family: str, layout: str) -> None:
    if layout == "EAGLE-1":  # Qwen2's EAGLE-1 heads carry q/k/v biases
        extra = {"qkv_bias": True} if family == "qwen2" else None
        make_head(directory, model, eagle3=False, seed=4, extra_config=extra)
    elif layout == "ModelOpt, null draft vocabulary":
        publish(directory, model, layout, draft_vocab=None, semantics=Semantics(lm_head_from_target=True))
    else:
        publish(directory, model, layout)


def reference_greedy(model, prompt: list[int], family: str) -> list[int]:
    """Greedy decoding's new tokens: transformers' ``generate``, or, for remote code written for transformers 4
    (whose forward transformers 5's generate cannot drive), the argmax of the model's own forward over the whole
    sequence at each step."""
    if family != "minicpm":
        return model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)[0, len(prompt):].tolist()
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
            if tokens[-1] == model.config.eos_token_id:
                break
    return tokens[len(prompt):]


@pytest.mark.parametrize("family,layout", PAIRS, ids=[f"{f}-{l}" for f, l in PAIRS])
def test_each_family_and_layout_is_lossless(family, layout, targets, tmp_path):
    base, model = targets(family)
    write_head(tmp_path / "head", model, family, layout)
    loaded = EaModel.from_pretrained(use_eagle3=layout != "EAGLE-1", base_model_path=str(base),
                                     ea_model_path=str(tmp_path / "head"), total_token=8, depth=3, top_k=3,
                                     trust_remote_code=family == "minicpm")
    reference = AutoModelForCausalLM.from_pretrained(base, trust_remote_code=family == "minicpm").eval()
    expected = [reference_greedy(reference, prompt, family) for prompt in PROMPTS]
    for prompt, tokens in zip(PROMPTS, expected):
        assert loaded.eagenerate(torch.tensor([prompt]), max_new_tokens=MAX_NEW)[0, len(prompt):].tolist() == tokens
    ids, mask = left_padded(PROMPTS)
    out, counts, _ = loaded.eagenerate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, log=True)
    width = ids.shape[1]
    assert [out[b, width : width + n].tolist() for b, n in enumerate(counts)] == expected

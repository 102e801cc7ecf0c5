"""The trainer on 2 ranks (torchrun, gloo on the CPU), against 1 rank on the same data: each sample is trained on
once per epoch, the loss falls as with 1 rank, the saved head loads into EaModel, and a checkpoint written by 2
ranks resumes on 1 and the other way round (DeepSpeed's ZeRO-2 optimizer state re-partitioned)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from eagle.traineagle3 import gen_data
from eagle.traineagle3.resume import joined_zero_state
from test_train_e2e import TRAIN_DIR, free_port, make_predictable_target, run

pytestmark = pytest.mark.e2e  # training on two ranks under torchrun


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranks")
    make_predictable_target(root / "base")
    data = root / "train.jsonl"
    assert gen_data.main(["--basepath", str(root / "base"), "--output", str(data), "--synthesize", "12", "--turns",
                          "1", "--max-new-tokens", "24", "--batch-size", "12", "--prompt-max-tokens", "16"]) == 0
    conversations = data.read_text().splitlines()
    data.write_text("\n".join(conversations[: len(conversations) // 2 * 2]) + "\n")  # an even number of samples
    return root, data


def train(root, data, savedir, ranks: int, epochs: int, grad_accum: int, ds_config: str = "ds_config.json"):
    args = ["--basepath", str(root / "base"), "--trainpath", str(data), "--savedir", str(savedir), "--epochs",
            str(epochs), "--draft_vocab_size", "64", "--lr", "3e-3", "--warmup_steps", "2", "--grad_accum",
            str(grad_accum), "--vocab_cache_dir", str(root / "vocab_cache"), "--deepspeed_config", ds_config]
    if ranks == 1:
        command = [sys.executable, "main.py", *args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
                   str(free_port()), "main.py", *args]
    result = run(command, cwd=TRAIN_DIR, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def epoch_record(savedir, epoch: int) -> dict:
    return json.loads((savedir / f"state_{epoch}" / "training_args.json").read_text())


def dataset_tokens(root, data) -> int:
    from eagle.traineagle3.data import ConversationDataset
    from transformers import AutoTokenizer

    return ConversationDataset(str(data), AutoTokenizer.from_pretrained(root / "base"), 2048).num_tokens()


def test_two_ranks_train_like_one_and_checkpoints_move_between_them(workspace):
    root, data = workspace
    # The same optimizer steps: 1 rank accumulating 2 micro batches, 2 ranks with 1 each.
    one, two = root / "one", root / "two"
    train(root, data, one, ranks=1, epochs=3, grad_accum=2)
    train(root, data, two, ranks=2, epochs=2, grad_accum=1)
    total = dataset_tokens(root, data)
    for savedir, epochs in ((one, 3), (two, 2)):
        for epoch in range(epochs):  # every sample once per epoch, on whichever rank
            assert epoch_record(savedir, epoch)["epoch_tokens"] == total
    assert epoch_record(two, 1)["world_size"] == 2 and epoch_record(one, 0)["world_size"] == 1

    def mean_loss(savedir, epoch):
        losses = epoch_record(savedir, epoch)["train_loss"]
        return sum(losses) / len(losses)

    assert mean_loss(two, 1) < mean_loss(two, 0)
    assert mean_loss(two, 1) == pytest.approx(mean_loss(one, 1), rel=0.15)

    # The 2-rank checkpoint resumes on 1 rank, and that one on 2 ranks again.
    resumed = train(root, data, two, ranks=1, epochs=3, grad_accum=2)
    assert "written by 2 ranks; re-partitioning" in resumed.stderr and "continuing at epoch 2" in resumed.stderr
    assert mean_loss(two, 2) == pytest.approx(mean_loss(one, 2), rel=0.15)
    back = train(root, data, two, ranks=2, epochs=4, grad_accum=1)
    assert "written by 1 ranks; re-partitioning" in back.stderr and "continuing at epoch 3" in back.stderr
    assert epoch_record(two, 3)["epoch_tokens"] == total
    assert mean_loss(two, 3) < mean_loss(two, 1)

    from eagle.model.ea_model import EaModel

    model = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(two / "state_3"),
                                    total_token=8, depth=3, top_k=3)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a story."}],
                                              add_generation_prompt=True, return_tensors="pt",
                                              return_dict=True)["input_ids"]
    assert torch.equal(model.eagenerate(ids, max_new_tokens=24), model.naivegenerate(ids, max_new_tokens=24))


def test_zero3_on_two_ranks_saves_and_exports_the_whole_head(workspace):
    """ZeRO-3 partitions the head's weights over the ranks: the saved head and the checkpoint's export are whole."""
    from safetensors.torch import load_file

    root, data = workspace
    savedir = root / "zero3"
    train(root, data, savedir, ranks=2, epochs=1, grad_accum=1, ds_config="ds_config_zero3.json")
    exported = run([sys.executable, "-m", "eagle.traineagle3.save_head", "--savedir", str(savedir), "--output",
                    str(savedir / "exported")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    saved, again = load_file(str(savedir / "state_0" / "model.safetensors")), load_file(str(savedir / "exported" / "model.safetensors"))
    assert saved.keys() == again.keys() and all(torch.equal(saved[k], again[k]) for k in saved)
    assert saved["fc.weight"].numel() == saved["fc.weight"].shape[0] * saved["fc.weight"].shape[1] > 0
    assert epoch_record(savedir, 0)["epoch_tokens"] == dataset_tokens(root, data)


def test_joined_zero_state_drops_the_partition_padding(tmp_path):
    """Two ranks' slices of a 5-element flat group padded to 6: joined back to the 5 elements, in order."""
    paths = []
    for rank, (part, padding) in enumerate(((torch.tensor([1.0, 2, 3]), 0), (torch.tensor([4.0, 5, 0]), 1))):
        state = {"optimizer_state_dict": {
            "zero_stage": 2, "group_paddings": [padding], "single_partition_of_fp32_groups": [part],
            "base_optimizer_state": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": part * 10,
                                                   "exp_avg_sq": part * 100}}}}}
        paths.append(str(tmp_path / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        torch.save(state, paths[-1])
    [group] = joined_zero_state(paths)
    assert group["fp32"].tolist() == [1, 2, 3, 4, 5]
    assert group["exp_avg"].tolist() == [10, 20, 30, 40, 50] and group["exp_avg_sq"][-1] == 500
    assert float(group["step"]) == 7

"""The one front door of the command lines (eagle.cli): every command has the same model flags, checked the same
way, and loads its model by the same embedded-pair rule; one stop rule and one template system serve them all."""

from __future__ import annotations

import pytest
import torch

from eagle import cli, defaults
from eagle.model.tuning.head_tree import embedded_tree_settings
from eagle.model.ea_model import EaModel

TREE = embedded_tree_settings()


def _parsers():
    """Each command's flag parser: argv -> parsed arguments."""
    from eagle.__main__ import parse_args as main_args
    from eagle.application.webui import parse_args as webui_args
    from eagle.application.server import parse_args as server_args
    from eagle.evaluation import benchmark, gen_answer, simulate
    from eagle.evaluation.answer_script import build_parser

    return {
        "python -m eagle": main_args,
        "webui": webui_args,
        "server": server_args,
        "benchmark": benchmark.build_parser().parse_args,
        "simulate": simulate.build_parser().parse_args,
        "gen_answer": build_parser(gen_answer.DEFAULTS).parse_args,
    }


COMMANDS = list(_parsers())


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_the_same_model_flags_and_old_spellings(command):
    parse = _parsers()[command]
    args = parse(["--base-model", "b", "--eagle-model", "h", "--no_eagle3", "--pack-cpu-weights", "off"])
    assert (args.base_model_path, args.ea_model_path, args.use_eagle3) == ("b", "h", False)
    options = cli.model_options(args)
    assert options.pack_cpu_weights is False and options.use_eagle3 is False
    assert parse(["--use-eagle3"]).use_eagle3 is True


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "simulate"])  # the simulator takes --trees
@pytest.mark.parametrize("argv, message", [
    (["--lookup-tokens", "-1"], "--lookup-tokens: must be >= 0"),
    (["--total-token", "0"], "--total-token: must be a positive tree size or -1"),
    (["--top-k", "x"], "--top-k: expected an integer"),
])
def test_tree_flags_are_checked_alike_by_every_command(command, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parsers()[command](argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert _parsers()[command](["--total-token", "-1", "--lookup-tokens", "0"]).lookup_tokens == 0


def test_one_embedded_pair_rule():
    base, head = defaults.default_base_model_path(), defaults.default_ea_model_path()
    assert defaults.resolve_model_paths(None, None) == (base, head)
    assert defaults.resolve_model_paths("mine", None) == ("mine", head)
    assert defaults.resolve_model_paths(None, "my-head") == (base, "my-head")
    assert defaults.resolve_model_paths(None, None, need_head=False) == (base, None)  # a baseline
    options = cli.ModelOptions(lookup_tokens=0, depth=3).resolved()
    assert (options.base_model_path, options.ea_model_path) == (base, head)
    assert options.tree == {"lookup_tokens": 0, "depth": 3}  # only what the user gave: the rest is the head's
    assert cli.ModelOptions().resolved().tree == {}


def test_the_embedded_head_tree_is_chosen_per_device_by_from_pretrained(monkeypatch):
    """No command passes the embedded head's CPU tree explicitly: from_pretrained reads the head's tree for the
    device the model lands on, so a GPU gets the head's GPU tree (the reference's while it has none)."""
    from eagle.model.tuning.head_tree import REFERENCE_TREE, head_tree_for, read_head_trees, resolve_tree

    calls = []
    monkeypatch.setattr(EaModel, "from_pretrained", classmethod(lambda cls, **kwargs: calls.append(kwargs)))
    for device in ("cpu", "cuda"):
        cli.load_model(cli.ModelOptions(device=device, dtype="float32"))
        assert not set(cli.TREE_KEYS) & set(calls[-1])
    config = {"eagle_tree": read_head_trees(defaults.default_ea_model_path())}
    on_cpu = resolve_tree({}, head_tree_for(config, torch.device("cpu")))[0]
    assert {k: getattr(on_cpu, k) for k in cli.TREE_KEYS} == TREE == embedded_tree_settings("cpu")
    on_gpu = resolve_tree({}, head_tree_for(config, torch.device("cuda")))[0]
    assert {k: getattr(on_gpu, k) for k in cli.TREE_KEYS} == embedded_tree_settings("cuda")
    if "cuda" not in config["eagle_tree"]:
        assert on_gpu == REFERENCE_TREE


def test_a_backend_s_own_tree_comes_before_the_device_s():
    from eagle.model.drafting.batch_tree import head_batch_trees
    from eagle.model.drafting.settings import TreeSettings
    from eagle.model.tuning.head_tree import head_tree_for

    cpu, own = {"total_token": 8, "depth": 2, "top_k": 4, "lookup_tokens": 16}, {"total_token": 3, "depth": 1}
    config = {"eagle_tree": {"cpu": cpu, "cpu-gguf": own},
              "eagle_batch_tree": {"cpu": {"2": {"total_token": 4}}, "cpu-gguf": {"4": {"total_token": 2}}}}
    device, base = torch.device("cpu"), TreeSettings(8, 2, 4, 0)
    assert head_tree_for(config, device, "gguf") == own and head_tree_for(config, device) == cpu
    assert head_tree_for({"eagle_tree": {"cpu": cpu}}, device, "gguf") == cpu  # none of its own: the device's
    assert list(head_batch_trees(config, device, base, "gguf")) == [4]
    assert list(head_batch_trees(config, device, base)) == [2]
    # int8 activations: their own key first, then the kernels', then the device's
    int8 = {"total_token": 2, "depth": 0}
    assert head_tree_for({"eagle_tree": {**config["eagle_tree"], "cpu-gguf-int8": int8}}, device, "gguf-int8") == int8
    assert head_tree_for(config, device, "gguf-int8") == own
    assert head_tree_for({"eagle_tree": {"cpu": cpu}}, device, "gguf-int8") == cpu


@pytest.fixture
def loads(monkeypatch):
    """The keyword arguments of every ``EaModel.from_pretrained`` call (which loads nothing here)."""
    calls = []
    monkeypatch.setattr(EaModel, "from_pretrained", classmethod(lambda cls, **kwargs: calls.append(kwargs) or "model"))
    return calls


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_loads_the_embedded_pair_the_same_way(command, loads):
    args = _parsers()[command](["--lookup-tokens", "3"] if command != "simulate" else [])
    assert cli.load_model_from_args(args) == "model"
    (call,) = loads
    assert call["base_model_path"] == defaults.default_base_model_path()
    assert call["ea_model_path"] == defaults.default_ea_model_path()
    assert args.base_model_path is None  # the flags stay as parsed (a server names the model by them)
    cli.resolve_model_args(args)  # what the benchmark calls to record the paths used
    assert (args.base_model_path, args.ea_model_path) == (call["base_model_path"], call["ea_model_path"])
    expected = {"lookup_tokens": 3} if command != "simulate" else {}
    assert {key: call[key] for key in TREE if key in call} == expected  # the rest is the head's for the device
    assert call["pack_cpu_weights"] == "auto" and call["use_eagle3"] is True
    if command == "python -m eagle":  # no placement flags: from_pretrained's own dtype and the CPU, as before
        assert "dtype" not in call and "device_map" not in call
    elif not torch.cuda.is_available():
        assert call["dtype"] == torch.float32 and "device_map" not in call


def test_given_paths_leave_the_tree_to_the_loader_and_missing_local_paths_say_which(loads, tmp_path, capsys):
    from eagle.evaluation import benchmark

    args = benchmark.build_parser().parse_args(["--base-model-path", str(tmp_path), "--ea-model-path", str(tmp_path),
                                                "--dtype", "bfloat16"])
    cli.load_model_from_args(args)
    assert not set(TREE) & set(loads[-1]) and loads[-1]["dtype"] == torch.bfloat16
    args = benchmark.build_parser().parse_args(["--ea-model-path", str(tmp_path / "nowhere")])
    with pytest.raises(SystemExit, match="--ea-model-path .*nowhere: no such file or directory"):
        cli.load_model_from_args(args)


def test_hugging_face_baselines_stop_where_the_engine_stops(tiny_pair):
    from eagle.evaluation.methods import engine_stop_ids

    model = EaModel.from_pretrained(base_model_path=str(tiny_pair[0]), ea_model_path=str(tiny_pair[1]))
    model.base_model.generation_config.eos_token_id = [2, 5]
    expected = sorted(model.stop_token_ids())
    assert 5 in expected
    assert engine_stop_ids(model.tokenizer, model.base_model) == expected == engine_stop_ids(
        model.tokenizer, model.base_model, model)


def test_one_template_system_for_the_web_ui_and_the_answer_scripts(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    from eagle import templates
    from eagle.application import prompts
    from eagle.evaluation import templates as evaluation_templates

    assert evaluation_templates.TEMPLATES is templates.TEMPLATES
    assert evaluation_templates.encode_prompt is templates.encode_prompt
    assert prompts.get_model_type("llama-2-chat").system_message == templates.TEMPLATES["llama2chat"].system_message
    assert prompts.LLAMA2_SYSTEM_PROMPT is templates.LLAMA_SYSTEM_PROMPT
    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    conversation = [("Hi", "Hello!"), ("How are you?", None)]
    for web, script in (("vicuna", "vicuna"), ("llama-3-instruct", "llama3chat"), (None, "auto")):
        assert prompts.build_prompt(tokenizer, conversation[:1], "How are you?", web).input_ids == (
            templates.encode_prompt(templates.get_template(script), tokenizer, conversation))
    # The reference demo writes a space before earlier llama-2 answers; its answer scripts do not.
    web = prompts.build_prompt(tokenizer, conversation[:1], "How are you?", "llama-2-chat").text
    script = templates.render_text(templates.get_template("llama2chat"), conversation)
    assert web == script.replace("[/INST] Hello!", "[/INST]  Hello!")

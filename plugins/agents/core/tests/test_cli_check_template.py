"""``rlplat check-template DIR``: exit 0 for an append-only chat template, 1 for one that is not (with the
first diverging message), 2 on bad input. The tokenizers are the tiny ones of
``rlplat.testing.chat_tokenizers``, saved to disk; two runs go through the installed console script (exit 1
and exit 2), the others through the same app or ``rlplat.cli.main.main`` in this process (loading
transformers once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlplat.cli.main import build_app
from rlplat.testing.chat_tokenizers import CHATML_TOOLS, LLAMA3_TOOLS, THINKING, save_chat_tokenizer



@pytest.fixture(scope="module")
def tokenizer_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {name: Path(save_chat_tokenizer(root / name, name)) for name in (CHATML_TOOLS, THINKING, LLAMA3_TOOLS)}


def check_template(*args):
    """``rlplat check-template ARGS`` in this process."""
    return CliRunner().invoke(build_app(), ["check-template", *map(str, args)])


def test_an_append_only_template_exits_0(cli_in_process, tokenizer_dirs):
    result = cli_in_process("check-template", str(tokenizer_dirs[CHATML_TOOLS]))
    assert result.returncode == 0, result.stderr
    assert f"Chat template of {tokenizer_dirs[CHATML_TOOLS]}: end of turn '<|im_end|>'" in result.stdout
    assert "│ parallel tool calls" in result.stdout
    assert result.stdout.splitlines()[-1] == "append-only: yes (11 conversations)"


def test_a_template_that_drops_earlier_reasoning_exits_1_naming_the_first_diverging_message(cli_run, tokenizer_dirs):
    result = cli_run("check-template", str(tokenizer_dirs[THINKING]))
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("│ reasoning + follow-up") and "│ no " in line and "│ 1 (assistant)" in line for line in lines)
    assert ("reasoning + follow-up: message 1 (assistant) diverges (turn by turn, text): the first 3 messages render "
            "the first 2 differently") in lines
    assert ("  expected: '... 3 * 4?<|im_end|>\\n<|im_start|>assistant\\n<think>\\nThree fours are twelve.\\n"
            "</think>\\n\\n12.<|im_end|>'") in lines
    assert lines[-1] == ("append-only: NO (2 of 14 conversations diverge): a multi-turn rollout's tokens would differ "
                         "from the template's rendering of its conversation")


def test_a_tokenizer_without_a_chat_template_exits_2(cli_in_process, tmp_path):
    from rlplat.testing.tiny_models import arithmetic_tokenizer

    DEMO_MODEL = tmp_path / "arithmetic"  # the demo model's tokenizer: no chat template
    arithmetic_tokenizer().save_pretrained(DEMO_MODEL)
    result = cli_in_process("check-template", str(DEMO_MODEL))
    assert result.returncode == 2
    assert result.stdout == ""
    assert f"rlplat check-template: the tokenizer in {DEMO_MODEL} has no chat template" in result.stderr


def test_a_missing_directory_exits_2(cli_run, tmp_path):
    result = cli_run("check-template", str(tmp_path / "missing"))
    assert result.returncode == 2
    assert f"rlplat check-template: {tmp_path / 'missing'} does not exist; pass a local model or tokenizer " \
           f"directory" in result.stderr


def test_the_llama3_template_exits_0(tokenizer_dirs):
    result = check_template(tokenizer_dirs[LLAMA3_TOOLS])
    assert result.exit_code == 0, result.output
    assert "end of turn '<|eot_id|>'" in result.stdout


def test_template_kwargs_reach_the_template(tokenizer_dirs):
    result = check_template(tokenizer_dirs[THINKING], "--template-kwargs", '{"keep_reasoning": true}')
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "append-only: yes (14 conversations)"


def test_json_output_carries_the_report(tokenizer_dirs):
    result = check_template(tokenizer_dirs[THINKING], "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["append_only"] is False and report["end_of_turn"] == "<|im_end|>"
    diverging = [entry for entry in report["conversations"] if entry["status"] == "diverges"]
    assert [entry["name"] for entry in diverging] == ["reasoning + follow-up", "reasoning + tools + follow-up"]
    assert diverging[0]["divergence"]["message_index"] == 1 and diverging[0]["divergence"]["role"] == "assistant"


@pytest.mark.parametrize("value, message", [
    ("{keep_reasoning: true}", "--template-kwargs is not valid JSON (Expecting property name enclosed in double quotes"),
    ("[1]", "--template-kwargs must be a JSON object of template variables, got '[1]'"),
    ('{"tools": []}', "template_kwargs may not set ['tools']: the renderer passes them itself"),
])
def test_bad_template_kwargs_exit_2(tokenizer_dirs, value, message):
    result = check_template(tokenizer_dirs[CHATML_TOOLS], "--template-kwargs", value)
    assert result.exit_code == 2
    assert f"rlplat check-template: {message}" in result.stderr


def test_a_directory_without_a_tokenizer_or_a_file_exits_2(tmp_path):
    result = check_template(tmp_path)
    assert result.exit_code == 2
    assert f"{tmp_path} holds no tokenizer (tokenizer_config.json or tokenizer.json)" in result.stderr
    (tmp_path / "notes.txt").write_text("x")
    result = check_template(tmp_path / "notes.txt")
    assert result.exit_code == 2
    assert f"{tmp_path / 'notes.txt'} is not a directory" in result.stderr

"""The README's set-up commands are the ones CI runs, and its example code runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2
    assert all("pip install torch==2.13.0" in c for c in cmds)


def test_readme_first_command_is_the_main_job():
    assert _setup_commands()[0].endswith("multihead inspect")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in ci


def _tiny_llama(path: pathlib.Path) -> str:
    """A local Llama-style checkpoint directory, for the README's Hugging Face example."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_readme_python_examples_run(tmp_path):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    namespace = {}
    for code in blocks:          # later blocks use names (torch, mh, x) from earlier ones
        if "path/to/llama" in code:
            code = code.replace("path/to/llama", _tiny_llama(tmp_path / "llama"))
            code += "\nassert model.config._attn_implementation == 'multihead'\n"
            code += "model(torch.tensor([[1, 2, 3]]))\n"
        exec(compile(code, "README.md", "exec"), namespace)

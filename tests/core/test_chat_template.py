"""pagoda.core.chat_template against transformers' apply_chat_template."""

from __future__ import annotations

import datetime

import pytest

from pagoda.core.chat_template import ChatTemplate, ChatTemplateError

CONVERSATIONS = {
    "user only": [{"role": "user", "content": "What is the capital of France?"}],
    "with system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of Italy?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Write `print(1)` in Python.\n  Indented line\n"},
        {"role": "assistant", "content": "```python\nprint(1)\n```"},
        {"role": "user", "content": "Thanks 😀 — 谢谢"},
    ],
    "system then turns": [
        {"role": "system", "content": ""},
        {"role": "user", "content": "<b>html & quotes ' \"</b>"},
        {"role": "assistant", "content": "ok"},
    ],
}

# A Llama-3-style template exercising what real templates use: bos_token, loop controls,
# raise_exception, tojson with options, a {% generation %} block, and whitespace control.
RICH_TEMPLATE = """{{- bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {% if message['role'] == 'assistant' %}
        {% generation %}{{- message['content'] | trim }}{% endgeneration %}
    {% else %}
        {{- message['content'] | trim }}
    {% endif %}
    {{- eos_token }}
    {% if loop.index > 6 %}{% break %}{% endif %}
{% endfor %}
{% if tools is defined %}{{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"""


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_default_template_matches_transformers(default_tokenizer, hf_gguf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    want = hf_gguf_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    got = default_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert got == want
    if messages[0]["role"] != "system":  # the template's own default system line
        assert got.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rich_template_matches_transformers(hf_gguf_tokenizer, name):
    messages = CONVERSATIONS[name]
    tools = [{"name": "lookup", "parameters": {"q": "<str> & 'x'"}}]
    want = hf_gguf_tokenizer.apply_chat_template(messages, chat_template=RICH_TEMPLATE, tools=tools, tokenize=False, add_generation_prompt=True)
    got = ChatTemplate(RICH_TEMPLATE).render(
        messages, add_generation_prompt=True, tools=tools,
        special_tokens={"bos_token": hf_gguf_tokenizer.bos_token, "eos_token": hf_gguf_tokenizer.eos_token},
    )
    assert got == want
    assert '"q": "<str> & \'x\'"' in got  # tojson did not HTML-escape


def test_raise_exception():
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ChatTemplate(RICH_TEMPLATE).render([{"role": "tool", "content": "x"}], special_tokens={"bos_token": "<s>"})


def test_trim_and_lstrip_blocks():
    template = "A\n  {% if true %}\n  B\n  {% endif %}\nC"
    assert ChatTemplate(template).render([]) == "A\n  B\nC"


def test_strftime_now_and_special_tokens():
    out = ChatTemplate("{{ bos_token }}{{ strftime_now('%Y') }}{{ unk_token is defined }}").render(
        [], special_tokens={"bos_token": "<s>", "unk_token": None}
    )
    assert out in {f"<s>{datetime.date.today().year + d}False" for d in (-1, 0, 1)}


def test_sandbox_blocks_mutation_and_internals():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


def test_errors():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="source"):
        ChatTemplate("")
    with pytest.raises(ValueError, match="messages"):
        ChatTemplate("x").render("not a list")
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        ChatTemplate("x").render([{"role": "user"}, {"content": "no role"}])


def test_a_template_that_reads_tools_gets_them_and_says_so():
    source = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
              "{% for m in messages %}{{ m.role }}:{{ m.content }}"
              "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}"
              "{% endfor %}")
    template = ChatTemplate(source)
    assert template.takes_tools and not ChatTemplate("{{ messages[0].content }}").takes_tools
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    text = template.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls}],
                           add_generation_prompt=False, tools=tools)
    assert text == '[get_weather]user:hiassistant:<get_weather {"city": "Paris"}>'

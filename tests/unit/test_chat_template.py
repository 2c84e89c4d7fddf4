"""A checkpoint's own chat template renders exactly as transformers' apply_chat_template renders it,
from tokenizers that transformers saved itself (chat_template.jinja, or the template inside
tokenizer_config.json, or a list of named templates); the fixed format is only for the presets."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from prefixpool.model.chat_template import ChatTemplateError
from prefixpool.model.tokenizer import ByteTokenizer, load_tokenizer
from prefixpool.router.cost_model import CostModel
from prefixpool.router.errors import InvalidRequest
from prefixpool.router.openai_schema import ChatBody, ChatMessage
from prefixpool.router.service import Router, RouterConfig
from prefixpool.store.keys import Namespace

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency (pip install -e .[dev])")

LLAMA3 = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
CHATML = """{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if not (message.role == 'system' and loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}")
# plain block tags on their own lines (trim_blocks, lstrip_blocks), tojson, continue, generation, strftime_now
BLOCKS = """{% for message in messages %}
    {% if message.role == 'system' %}{% continue %}{% endif %}
<{{ message.role }}>{% generation %}{{ message | tojson }}{% endgeneration %}</s>
{% endfor %}
{% if add_generation_prompt %}
<assistant year="{{ strftime_now('%Y') }}">
{% endif %}
"""
TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML, "mistral": MISTRAL, "blocks": BLOCKS}
CHAT = [{"role": "system", "content": "  Be brief. <b>é</b> \"quoted\"  "},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "cache 世界"},
        {"role": "user", "content": "again & again"}]


def save_tokenizer(directory, template):
    """A word-level tokenizer wrapped and saved by transformers, with BOS/EOS and a chat template."""
    words = "hello world cache again & 世界 brief be".split()
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                   unk_token="[UNK]")
    wrapped.chat_template = template
    wrapped.save_pretrained(directory)
    return transformers.AutoTokenizer.from_pretrained(directory)


def conversation(name):
    return CHAT[1:] if name == "mistral" else CHAT   # mistral's template refuses a system turn


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_equals_transformers(tmp_path, name):
    hf = save_tokenizer(tmp_path, TEMPLATES[name])
    assert (tmp_path / "chat_template.jinja").is_file()
    ours = load_tokenizer(tmp_path).apply_chat_template(conversation(name))
    assert ours == hf.apply_chat_template(conversation(name), tokenize=False, add_generation_prompt=True)
    assert ours != ByteTokenizer().apply_chat_template(conversation(name))


@pytest.mark.parametrize("layout", ["string", "named-list"])
def test_a_template_inside_tokenizer_config_json(tmp_path, layout):
    hf = save_tokenizer(tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML if layout == "string" else [{"name": "tool_use", "template": LLAMA3},
                                                                 {"name": "default", "template": CHATML}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    expected = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True, chat_template=CHATML)
    assert load_tokenizer(tmp_path).apply_chat_template(CHAT) == expected


def test_raise_exception_in_a_template_is_a_chat_template_error(tmp_path):
    hf = save_tokenizer(tmp_path, MISTRAL)
    bad = [{"role": "user", "content": "hello"}, {"role": "user", "content": "again"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        load_tokenizer(tmp_path).apply_chat_template(bad)


def test_a_checkpoint_tokenizer_without_a_template_refuses_chat(tmp_path):
    save_tokenizer(tmp_path, None)
    assert not (tmp_path / "chat_template.jinja").exists()
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        load_tokenizer(tmp_path).apply_chat_template(CHAT)


def test_a_template_that_does_not_parse_is_refused_at_load(tmp_path):
    save_tokenizer(tmp_path, CHATML)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        load_tokenizer(tmp_path)


def test_the_router_tokenizes_the_rendered_chat_as_transformers_does_and_answers_400_on_refusal(tmp_path):
    hf = save_tokenizer(tmp_path, MISTRAL)
    tokenizer = load_tokenizer(tmp_path)
    config = RouterConfig(model="m", namespace=Namespace("m", block_size=4), max_context=1000,
                          vocab_size=tokenizer.vocab_size)
    router = Router(config, tokenizer, view=None, client=None, costs=CostModel())
    chat = [ChatMessage(role=m["role"], content=m["content"]) for m in CHAT[1:]]
    prepared = router.prepare(ChatBody(model="m", messages=chat))
    text = hf.apply_chat_template(CHAT[1:], tokenize=False, add_generation_prompt=True)
    assert prepared.tokens == hf.encode(text, add_special_tokens=False)
    assert prepared.tokens[0] == hf.bos_token_id
    with pytest.raises(InvalidRequest, match="roles must alternate") as caught:
        router.prepare(ChatBody(model="m", messages=chat[:1] * 2))
    assert (caught.value.status, caught.value.param) == (400, "messages")

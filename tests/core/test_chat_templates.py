"""Real chat templates (Qwen2.5-Instruct, Llama-3.1 with JSON tools; fixtures in
tests/fixtures/chat_templates, sources in their headers) on a locally built byte-level tokenizer:
multi-turn episodes of the calculator's tool calls (hermes on both, and Llama-3.1's own JSON
calls), built turn by turn by the episode runner, are token for token what the template renders
for the whole conversation, and the ids the model sampled are kept as they were, never encoded
again from text."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from posttrain.config.data_sections import DataConfig
from posttrain.config.sections import EnvironmentConfig
from posttrain.protocol import RolloutSamples, SamplingParams
from posttrain.rollout.environments.builtin import posttrain_add_environments
from posttrain.rollout.environments.calculator import CalculatorConfig, calculator_environment
from posttrain.rollout.environments.protocol import ModelTurn
from posttrain.rollout.environments.runner import EpisodeRunner
from posttrain.tasks.data import load_prompts

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
# Merges the model's sampled ids below do not use: encoding their text again would merge them.
MERGES = [("Ċ", "Ċ"), ("a", "r")]
QUESTION = "What is 12*3+4?"
CALL = {"name": "calculator", "arguments": {"expression": "12*3+4"}}


@attrs.frozen
class Family:
    template: str
    special: tuple[str, ...]  # control tokens (special, skipped when a turn is decoded)
    added: tuple[str, ...]  # added tokens that stay in the text (Qwen2.5's <tool_call>)
    eos: str
    bos: str | None
    syntax: str  # the calculator's call syntax
    # The model's call turn as it samples it: up to the stop string </tool_call> (hermes), or
    # the whole turn, closed by the model's end-of-turn token (llama3_json).
    call_text: str
    # The call turn as a message of the whole conversation.
    call_message: dict
    # What the template writes after the end-of-turn token of a conversation's last turn.
    trailing: str


QWEN = Family(
    template="qwen2.5_instruct.jinja",
    special=("<|im_start|>", "<|im_end|>", "<|endoftext|>"),
    added=("<tool_call>", "</tool_call>"),
    eos="<|im_end|>",
    bos=None,
    syntax="hermes",
    call_text='<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*3+4"}}\n'
    "</tool_call>",
    # Qwen2.5 renders a structured call exactly as the model writes it.
    call_message={"role": "assistant", "content": "", "tool_calls": [{"function": CALL}]},
    trailing="\n",
)
LLAMA_TOKENS = dict(
    template="llama3.1_json.jinja",
    special=(
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    added=(),
    eos="<|eot_id|>",
    bos="<|begin_of_text|>",
    trailing="",
)
LLAMA_HERMES = Family(
    **LLAMA_TOKENS,
    syntax="hermes",
    call_text='<tool_call>{"name": "calculator", "arguments": {"expression": "12*3+4"}}'
    "</tool_call>",
    # Llama-3.1 renders structured calls in its own JSON format: a hermes call is the turn's text.
    call_message={
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12*3+4"}}'
        "</tool_call>",
    },
)
# Llama-3.1's own format: the template renders a structured call as the model writes it.
LLAMA_JSON = Family(
    **LLAMA_TOKENS,
    syntax="llama3_json",
    call_text='{"name": "calculator", "parameters": {"expression": "12*3+4"}}',
    call_message={"role": "assistant", "tool_calls": [{"function": CALL}]},
)


def build_tokenizer(family: Family):
    """Byte-level BPE over all 256 bytes (any text encodes), Qwen2's pre-tokenizer, two merges,
    and the family's control tokens; the template is the fixture file as it is."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models
    from tokenizers import pre_tokenizers as pre
    from transformers import PreTrainedTokenizerFast

    from posttrain.tasks.presets import QWEN2_PRETOKENIZE_REGEX

    vocab = {t: i for i, t in enumerate(["<pad>", *sorted(pre.ByteLevel.alphabet())])}
    for left, right in MERGES:
        vocab[left + right] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre.Sequence(
        [
            pre.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(family.special)})
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in family.added])
    tokenizer.eos_token = family.eos
    if family.bos is not None:
        tokenizer.bos_token = family.bos
    tokenizer.chat_template = (TEMPLATES / family.template).read_text()
    return tokenizer


@pytest.fixture(
    scope="module",
    params=[QWEN, LLAMA_HERMES, LLAMA_JSON],
    ids=["qwen2.5-hermes", "llama3.1-hermes", "llama3.1-json"],
)
def family(request):
    return request.param, build_tokenizer(request.param)


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def template_ids(tokenizer, messages, tools, generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def split_merges(tokenizer, ids: list[int]) -> list[int]:
    """The same text with every merged token sampled as its two halves (not what encoding the
    text gives)."""
    out = []
    for token, i in zip(tokenizer.convert_ids_to_tokens(ids), ids):
        halves = next(((a, b) for a, b in MERGES if a + b == token), None)
        out += tokenizer.convert_tokens_to_ids(list(halves)) if halves else [i]
    return out


class ScriptedModel:
    """``generate`` for the runner: the model samples the given turns, in order; keeps each
    round's contexts."""

    def __init__(self, turns: list[list[int]]):
        self.turns = turns
        self.contexts: list[list[int]] = []
        self.stops: tuple[str, ...] = ()

    def __call__(self, contexts, sampling, turn):
        assert len(contexts) == 1
        self.contexts.append(list(contexts[0]))
        self.stops = sampling.stop
        ids = self.turns[turn]
        return RolloutSamples(
            prompt_ids=contexts, response_ids=[ids], response_logprobs=[[-0.5] * len(ids)]
        )


def run_episode(family: Family, tokenizer, tmp_path, turns: list[list[int]]):
    """One calculator episode on the question, its prompt rendered by load_prompts with the
    environment's tools, as a run renders it."""
    spec = posttrain_add_environments()["calculator"]
    config = EnvironmentConfig(
        name="calculator", kwargs=CalculatorConfig(syntax=family.syntax), max_total_tokens=4096
    )
    tools = spec.tool_schemas(config.kwargs)
    data = DataConfig(path="data.jsonl", max_prompt_length=4096)  # a byte per token
    (tmp_path / "data.jsonl").write_text(f'{{"prompt": "{QUESTION}", "answer": "40"}}\n')
    prompts = load_prompts(data, str(tmp_path), tokenizer, tools)
    model = ScriptedModel(turns)
    runner = EpisodeRunner(spec, config, tokenizer)
    out = runner.run(prompts, 1, model, SamplingParams(max_new_tokens=256), "step 1")
    return out, model, tools


def model_turns(family: Family, tokenizer) -> list[list[int]]:
    """The call turn and the answer (closed by end-of-turn)."""
    eos = tokenizer.convert_tokens_to_ids(family.eos)
    call = text_ids(tokenizer, family.call_text)
    if family.syntax == "llama3_json":  # no stop string: the model ends the turn itself
        call.append(eos)
    return [call, [*text_ids(tokenizer, "40"), eos]]


def conversation(family: Family) -> list[dict]:
    return [
        {"role": "user", "content": QUESTION},
        family.call_message,
        {"role": "tool", "content": "40"},
        {"role": "assistant", "content": "40"},
    ]


def test_each_turn_is_what_the_template_renders_for_the_conversation(family, tmp_path):
    spec, tokenizer = family
    turns = model_turns(spec, tokenizer)
    out, model, tools = run_episode(spec, tokenizer, tmp_path, turns)
    messages = conversation(spec)
    assert tools and tools[0]["function"]["name"] == "calculator"
    assert ("</tool_call>" in model.stops) == (spec.syntax == "hermes")
    assert out.metrics["env/tool_calls_mean"] == 1 and out.metrics["env/errors"] == 0
    # Before each model turn, the context is the template's rendering of the conversation so
    # far with its generation prompt: the prompt with the tool list, then the call and its
    # result as the template writes a tool message.
    assert model.contexts[0] == template_ids(tokenizer, messages[:1], tools, True)
    assert model.contexts[1] == template_ids(tokenizer, messages[:3], tools, True)
    # The finished episode is the whole conversation's rendering, up to the text the template
    # writes after the model's closing token.
    samples = out.samples
    episode = samples.prompt_ids[0] + samples.response_ids[0]
    whole = template_ids(tokenizer, messages, tools, False)
    assert episode == whole[: len(episode)]
    assert whole[len(episode) :] == text_ids(tokenizer, spec.trailing)
    # Loss mask 1 exactly on the model's tokens, which are there as sampled.
    response, mask = samples.response_ids[0], samples.loss_mask[0]
    assert [i for i, m in zip(response, mask) if m] == turns[0] + turns[1]
    assert response[: len(turns[0])] == turns[0] and response[-len(turns[1]) :] == turns[1]


def test_sampled_ids_are_never_encoded_again(family, tmp_path):
    spec, tokenizer = family
    canonical = model_turns(spec, tokenizer)
    # "arguments" / "parameters" sampled with a, r rather than the merged "ar": the same
    # text, other ids.
    turns = [split_merges(tokenizer, canonical[0]), canonical[1]]
    assert turns[0] != canonical[0]
    assert tokenizer.decode(turns[0]) == tokenizer.decode(canonical[0])
    out, model, tools = run_episode(spec, tokenizer, tmp_path, turns)
    samples = out.samples
    response, mask = samples.response_ids[0], samples.loss_mask[0]
    assert response[: len(turns[0])] == turns[0]
    assert [i for i, m in zip(response, mask) if m] == turns[0] + turns[1]
    # The next turn's context extends the first one's with those very ids.
    assert model.contexts[1][: len(model.contexts[0]) + len(turns[0])] == (
        model.contexts[0] + turns[0]
    )
    # The environment read the call from their text, and the episode's text is the template's.
    assert out.metrics["env/tool_calls_mean"] == 1
    episode = samples.prompt_ids[0] + response
    whole = tokenizer.apply_chat_template(conversation(spec), tools=tools, tokenize=False)
    assert tokenizer.decode(episode) + spec.trailing == whole


def test_only_template_call_syntaxes_give_the_template_a_tool_list(monkeypatch):
    """Compact calls are not a template's format: announcing tools would ask the model for
    calls the environment does not read."""
    from posttrain.host.plugin_host import create_plugin_host
    from posttrain.rollout.environments.registry import prompt_tools

    monkeypatch.setenv("POSTTRAIN_PLUGINS", "hf_infer")
    hook = create_plugin_host().hook
    hermes, compact = (
        EnvironmentConfig(name="calculator", kwargs=CalculatorConfig(syntax=syntax))
        for syntax in ("hermes", "compact")
    )
    (tool,) = prompt_tools(hermes, hook)
    assert tool["function"]["name"] == "calculator"
    assert tool["function"]["parameters"]["required"] == ["expression"]
    assert prompt_tools(compact, hook) is None and prompt_tools(EnvironmentConfig(), hook) is None


def test_llama_json_calls_and_their_mistakes():
    env = calculator_environment(CalculatorConfig(syntax="llama3_json"))

    def step(text):
        return env.step(ModelTurn(text=text, ids=(), index=0))

    call = step(' {"name": "calculator", "parameters": {"expression": "6*7"}} ')
    assert (call.observation, call.tool_calls, call.role, call.done) == ("42", 1, "tool", False)
    for bad, why in [
        ('{"name": "calculator", "parameters": {"expression": "6*7"}', "not JSON"),
        ('{"name": "abacus", "parameters": {}}', "unknown tool"),
        ('{"name": "calculator", "arguments": {"expression": "6*7"}}', "bad arguments"),
    ]:
        answer = step(bad)
        assert answer.tool_calls == 0 and why in answer.observation and not answer.done
    assert step("42").done and step("42").answer == "42"
    # Llama-3.1's built-in tools are called with <|python_tag|> code (a special token, skipped
    # when the turn is decoded): no syntax reads those calls, the turn is the final answer.
    builtin = step('calculator.call(expression="6*7")')
    assert builtin.done and builtin.tool_calls == 0

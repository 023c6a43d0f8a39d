"""Chat templates in the shape of other model families' tool calling, for the tiny test model (its tokenizer's
`<|im_start|>` / `<|im_end|>` stand in for each family's own turn markers): Llama 3.x's JSON calls with their
"parameters" key, and Mistral's `[TOOL_CALLS]` array; and the tool the tool-call tests declare."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}

LLAMA3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\nGiven the following functions, respond with a JSON for a function call, in the format '
        '{"name": function name, "parameters": dictionary of argument name and its value}.\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson + '\\n' }}
    {%- endfor %}
    {{- '<|im_end|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {{- '<|im_start|>ipython\\n' + message['content'] + '<|im_end|>' }}
    {%- elif message.get('tool_calls') %}
        {{- '<|im_start|>assistant\\n' }}
        {%- for call in message['tool_calls'] %}
            {{- '{"name": "' + call['function']['name'] + '", "parameters": ' }}
            {{- call['function']['arguments'] | tojson + '}' }}
        {%- endfor %}
        {{- '<|im_end|>' }}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL_TEMPLATE = """\
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools and loop.last %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]{"content": ' + message['content'] | tojson + '}[/TOOL_RESULTS]' }}
    {%- elif message.get('tool_calls') %}
        {{- '[TOOL_CALLS][' }}
        {%- for call in message['tool_calls'] %}
            {{- '{"name": "' + call['function']['name'] + '", "arguments": ' }}
            {{- call['function']['arguments'] | tojson + '}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']<|im_end|>' }}
    {%- else %}
        {{- message['content'] + '<|im_end|>' }}
    {%- endif %}
{%- endfor %}
"""

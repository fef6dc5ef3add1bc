"""A chat template with tools for models whose tokenizer has none (tests, tiny demo models).

ChatML with the Hermes/Qwen2.5 tool conventions: tool schemas listed in the system turn,
calls as `<tool_call>{json}</tool_call>`, consecutive tool results grouped in one user turn as
`<tool_response>...</tool_response>`. It only appends (earlier turns render the same whatever
follows), which token-in-token-out needs.
"""

TOOL_CHAT_TEMPLATE = (
    # transformers renders with trim_blocks: a newline right after a `%}` is dropped, so those
    # newlines are written as {{ '\\n' }}
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    'For each call, write <tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
    "</tool_call><|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

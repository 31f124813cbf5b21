"""Qwen3.5's chat template, reduced to what the gateway's tests need: its tools block, its tool-call format and its
generation prompt, in the published template's own lines (Qwen/Qwen3.5-*'s chat_template.jinja, the same as
Qwen3-Next's and Qwen3-Coder's for the calls): a call is `<tool_call>` around `<function=NAME>` and one
`<parameter=KEY>` block per argument, a string written as it is and anything else as JSON; the prompt opens the
reasoning block itself (`<think>\\n`), or writes an empty one with enable_thinking false. Images, the multi-step
reasoning rules and the refusals of the published template are left out.
"""

QWEN35_CHAT_TEMPLATE = """\
{%- if tools and tools is iterable and tools is not mapping %}
  {{- '<|im_start|>system\\n' }}
  {{- "# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>" }}
  {%- for tool in tools %}
    {{- "\\n" }}
    {{- tool | tojson }}
  {%- endfor %}
  {{- "\\n</tools>" }}
  {{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n'
    '<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n'
    '</tool_call>' }}
  {%- if messages[0].role == 'system' %}
    {{- '\\n\\n' + messages[0].content | trim }}
  {%- endif %}
  {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
  {{- '<|im_start|>system\\n' + messages[0].content | trim + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
  {%- set content = message.content | trim %}
  {%- if message.role == "user" %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
  {%- elif message.role == "assistant" %}
    {{- '<|im_start|>' + message.role + '\\n' + content }}
    {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
      {%- for tool_call in message.tool_calls %}
        {%- if tool_call.function is defined %}
          {%- set tool_call = tool_call.function %}
        {%- endif %}
        {%- if loop.first %}
          {%- if content|trim %}
            {{- '\\n\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
          {%- else %}
            {{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
          {%- endif %}
        {%- else %}
          {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
        {%- endif %}
        {%- if tool_call.arguments is defined %}
          {%- for args_name, args_value in tool_call.arguments|items %}
            {{- '<parameter=' + args_name + '>\\n' }}
            {%- set args_value = args_value | string if args_value is string else args_value | tojson | safe %}
            {{- args_value }}
            {{- '\\n</parameter>\\n' }}
          {%- endfor %}
        {%- endif %}
        {{- '</function>\\n</tool_call>' }}
      {%- endfor %}
    {%- endif %}
    {{- '<|im_end|>\\n' }}
  {%- elif message.role == "tool" %}
    {%- if loop.previtem and loop.previtem.role != "tool" %}
      {{- '<|im_start|>user' }}
    {%- endif %}
    {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
    {%- if loop.last or loop.nextitem.role != "tool" %}
      {{- '<|im_end|>\\n' }}
    {%- endif %}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
  {{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}
    {{- '<think>\\n\\n</think>\\n\\n' }}
  {%- else %}
    {{- '<think>\\n' }}
  {%- endif %}
{%- endif %}
"""

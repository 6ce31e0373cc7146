"""The built-in tool-call parsers: Hermes-style tags (the default) and Llama-3's JSON calls.

    hermes   <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>   (any text around;
             several calls one after another). Qwen 2.5, Hermes 2/3 and most ChatML tool models write this.
    llama3   {"name": "get_weather", "parameters": {"city": "Paris"}}   the whole answer (optionally after
             <|python_tag|>), several calls separated by `;`. Llama 3.1-3.3's JSON tool format.
"""

from __future__ import annotations

from pagoda.plugins.hookspecs import hookimpl
from pagoda.plugins.tools import ToolParser


class HermesParser(ToolParser):
    name = "hermes"
    begin = "<tool_call>"
    end = "</tool_call>"
    key = "arguments"
    trigger = "<tool_call>"

    def call_prefix(self, name: str) -> str:
        return super().call_prefix(name).replace(self.begin, self.begin + "\n", 1)

    def call_suffix(self) -> str:
        return "}\n" + self.end


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    key = "parameters"
    trigger = '{"name": '

    def result_message(self, content: str) -> dict[str, str]:
        return {"role": "ipython", "content": content}

    def format_hint(self) -> str:
        return ("To call a function, reply with only " + self.call_text("<function-name>", "<arguments-json-object>")
                + "; separate several calls with ';'.")


HERMES = HermesParser()
LLAMA3_JSON = Llama3JsonParser()


@hookimpl
def pagoda_register_tool_parsers(register):
    register(HERMES)
    register(LLAMA3_JSON)

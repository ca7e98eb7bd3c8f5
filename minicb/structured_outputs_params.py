"""StructuredOutputsParams (vLLM's name, in vLLM's sampling_params.py): the constraint a request's
output must follow. Pure data, validated on construction; minicb.sampling_params re-exports it.
The grammar engine that enforces it is minicb/structured_output/."""

from dataclasses import dataclass


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured outputs (the names that replaced guided_json, guided_regex, guided_choice
    and guided_grammar in vLLM 0.12): exactly one constraint on what the request may generate.
    The engine compiles it to a grammar and masks, at every step, the tokens that would break it
    (minicb/structured_output/)."""

    json: str | dict | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None  # the whole output matches this regular expression
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a context-free grammar: Lark (llguidance's syntax) or GBNF
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    # JSON without the optional whitespace between tokens (vLLM's option of the same name)
    disable_any_whitespace: bool = False

    def __post_init__(self):
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object is True else []
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar and "
                f"json_object, got {kinds or 'none'}"
            )
        (kind,) = kinds
        value = getattr(self, kind)
        if kind == "json" and not isinstance(value, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema, got {value!r:.80}")
        if kind in ("regex", "grammar") and not (isinstance(value, str) and value):
            raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        if kind == "choice":
            choices = (value,) if isinstance(value, str) else value
            is_list = not isinstance(choices, dict) and hasattr(choices, "__iter__")
            if not (is_list and (choices := tuple(choices))) or not all(
                isinstance(c, str) and c for c in choices
            ):
                raise ValueError("structured_outputs.choice must be a list of non-empty strings")
            object.__setattr__(self, "choice", choices)
        for flag in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"structured_outputs.{flag} must be true or false")

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        kinds = ("json", "regex", "choice", "grammar")
        return next(k for k in kinds if getattr(self, k) is not None)

    @classmethod
    def of(cls, value) -> "StructuredOutputsParams | None":
        """None, a StructuredOutputsParams, or its fields as a dict (a JSON request body)."""
        if value is None or isinstance(value, StructuredOutputsParams):
            return value
        if isinstance(value, dict):
            unknown = set(value) - set(cls.__dataclass_fields__)
            if unknown:
                raise ValueError(
                    f"unknown structured_outputs fields {sorted(unknown)}; minicb knows "
                    f"{sorted(cls.__dataclass_fields__)}"
                )
            return cls(**value)
        raise ValueError(f"structured_outputs must be an object, got {type(value).__name__}")

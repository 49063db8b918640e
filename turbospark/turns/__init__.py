"""What a generation turn means, without I/O: the conversation shaped for a chat template
(``chat``), tools, ``tool_choice`` and the grammars of structured output (``structured``), the
guardrails' rescue, validation and retry verdict (``guardrails``), and the stored Responses
conversations (``conversations``). No Trio, no MLX, no HTTP: tested directly. It may import
``errors`` and ``model``'s sans-io types (tool calls); routes and the system import it."""

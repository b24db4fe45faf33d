"""Chat examples: every item asked about in several phrasings, sometimes under a system prompt
and sometimes as the second turn of a conversation, plus a few hand-written small talk items."""

from __future__ import annotations

import random

from .corpus import Item

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant that answers questions about Python.",
    "You are demo-chat, a small model that explains Python's standard library.",
    "Answer the user's question concisely.",
    "You are a friendly programming assistant.",
]
QUESTIONS = {
    "function": [
        "What does {n} do?",
        "Explain {n}.",
        "How do I use {n}?",
        "What is {n}?",
        "What is {n} used for?",
        "Tell me about {n}.",
        "Can you explain {n} in Python?",
        "What does the {n} function do?",
        "How does {n} work?",
        "{n}?",
    ],
    "method": [
        "What does {n} do?",
        "Explain {n}.",
        "How do I use {n}?",
        "What is {n}?",
        "What does the {n} method do?",
        "Tell me about {n}.",
        "How does {n} work?",
    ],
    "class": [
        "What is {n}?",
        "Explain {n}.",
        "What is the {n} class?",
        "How do I use {n}?",
        "Tell me about {n}.",
        "What is {n} used for?",
        "What does {n} do?",
    ],
    "module": [
        "What is the {n} module for?",
        "What does the {n} module do?",
        "Tell me about the {n} module.",
        "Explain Python's {n} module.",
        "What is {n}?",
        "How do I use the {n} module?",
    ],
    "topic": [
        "What is {n}?",
        "Explain {n}.",
        "How does {n} work in Python?",
        "Tell me about {n}.",
        "What are {n}?",
        "Can you explain {n}?",
        "How do I use {n}?",
        "What is {n} in Python?",
        "Describe {n}.",
    ],
}
GREETINGS = (
    ["Hello", "Hi", "Hi there!", "Hey", "Good morning", "Hello!", "hi"],
    "Hello! I am demo-chat, a small model trained on the documentation that ships with "
    "Python. Ask me about a standard-library module, a function or a language feature, "
    "for example: What does json.dumps do?",
)
ABOUT = (
    ["Who are you?", "What are you?", "What can you do?", "What can you help me with?"],
    "I am demo-chat, a small language model trained on this project's own machines from "
    "Python's built-in documentation. I can explain standard-library modules, functions and "
    "language features such as the with statement. I am small and make mistakes, so check "
    "the official documentation for anything important.",
)
THANKS = (
    ["Thanks", "Thank you!", "thanks a lot", "Great, thanks."],
    "You're welcome! Ask me anything else about Python.",
)


def chat_items() -> list[Item]:
    return [
        Item("chat", f"chat-{i}", answer, (), tuple(qs))
        for i, (qs, answer) in enumerate([GREETINGS, ABOUT, THANKS])
    ]


def pick_questions(item: Item, per_name: int, rng: random.Random) -> list[str]:
    """``per_name`` questions for each name of ``item`` (for chat items, copies of each fixed
    question), each name going through its own shuffle of the templates."""
    if item.kind == "chat":
        return list(item.questions) * per_name
    templates = QUESTIONS[item.kind]
    questions: list[str] = []
    for name in item.names or (item.name,):
        # Not "How does Python's with statement work in Python?".
        usable = [t for t in templates if "Python" not in t or "Python" not in name]
        shuffled = rng.sample(usable, len(usable))
        questions += [shuffled[i % len(usable)].format(n=name) for i in range(per_name)]
    return questions


def make_conversations(
    items: list[Item], rng: random.Random, phrasings: dict[str, int]
) -> list[list[dict[str, str]]]:
    """Single-turn Q&A per item, name and phrasing (``phrasings`` per name, by kind), some
    with a system prompt or a previous turn.

    Phrasings go per name because a name that the answer does not repeat word for word must be
    learnt from its own examples: "the with statement" is answered with "The `with`
    statement ...", and a plain " with" is a different token from the "with" in backticks,
    one that a small model otherwise confuses with " for"."""
    turns: list[tuple[str, str]] = []
    for item in items:
        for question in pick_questions(item, phrasings[item.kind], rng):
            if rng.random() < 0.15 and question[0].isupper():
                question = question[0].lower() + question[1:]
            turns.append((question, item.answer))
    rng.shuffle(turns)
    conversations: list[list[dict[str, str]]] = []
    i = 0
    while i < len(turns):
        messages: list[dict[str, str]] = []
        if rng.random() < 0.15:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        num_turns = 2 if rng.random() < 0.1 else 1
        for question, answer in turns[i : i + num_turns]:
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": answer},
            ]
        conversations.append(messages)
        i += num_turns
    return conversations

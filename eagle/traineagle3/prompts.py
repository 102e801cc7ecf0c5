"""Prompt sources for self-distillation: ShareGPT-style files, question files in the MT-bench format, and
prompts the target writes itself.

Synthesized prompts need no dataset: the target's chat template is opened at a user turn, a short opening
(a task type, sometimes with a topic) is written there, and the target continues the user's message with
sampling. About one prompt in six gets no opening at all, so the model's own idea of a user request is in the
mix too. Follow-up turns are written the same way after the conversation so far.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field

from eagle.utils.jsonl import read_jsonl

from .chat import USER, normalize_conversation

logger = logging.getLogger(__name__)


@dataclass
class PromptItem:
    """One conversation to answer. ``user_turns`` holds the given user messages; ``None`` entries are
    synthesized by the target (``seeds`` gives the opening written for them)."""

    id: str
    source: str
    user_turns: list[str | None]
    system: str | None = None
    seeds: list[str] = field(default_factory=list)


def read_json_records(path: str) -> list[dict]:
    """A JSON list or a JSONL file of objects."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data file {path} does not exist.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if not stripped:
        return []
    if stripped.startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} starts like a JSON list but is not valid JSON: {err}") from err
    else:
        try:
            records = [record for _, record in read_jsonl(path)]
        except ValueError as err:
            raise ValueError(f"{err} Expected JSONL or a JSON list.") from err
    if not all(isinstance(record, dict) for record in records):
        raise ValueError(f"{path} must hold JSON objects (one per line, or a list of them).")
    return records


def sharegpt_prompts(path: str, max_turns: int) -> list[PromptItem]:
    """User turns of ShareGPT-style conversations (the original answers are discarded and regenerated)."""
    items = []
    for index, record in enumerate(read_json_records(path)):
        messages = normalize_conversation(record)
        system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
        users = [m["content"] for m in messages if m["role"] == USER][:max_turns]
        if users:
            items.append(PromptItem(f"sharegpt-{record.get('id', index)}", "sharegpt", users, system))
    return items


def question_prompts(path: str, max_turns: int) -> list[PromptItem]:
    """Questions in the MT-bench format: ``{"question_id", "category", "turns": [str, ...]}`` per line."""
    items = []
    for index, record in enumerate(read_json_records(path)):
        turns = record.get("turns")
        if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
            raise ValueError(f"{path}: question {index} needs a 'turns' list of strings (MT-bench format).")
        if turns:
            items.append(PromptItem(f"question-{record.get('question_id', index)}", "questions", turns[:max_turns]))
    return items


# -- synthesized prompts ------------------------------------------------------------------------------------

TOPICS = [
    "the ocean", "a small bakery", "climate change", "the history of Rome", "black holes", "a job interview",
    "learning a new language", "a rainy afternoon", "electric cars", "healthy breakfast ideas", "time management",
    "the French Revolution", "photosynthesis", "a haunted lighthouse", "online privacy", "volcanoes",
    "a friendship between a robot and a cat", "remote work", "the stock market", "ancient Egypt", "honeybees",
    "a mountain hiking trip", "machine learning", "the water cycle", "a birthday party", "chess strategy",
    "renewable energy", "a detective in Tokyo", "sleep and memory", "the printing press", "coffee",
    "space exploration", "a first day at school", "recycling", "the human immune system", "jazz music",
    "a lost dog", "public transportation", "the Renaissance", "earthquakes", "social media", "gardening",
    "a dragon who is afraid of fire", "budgeting for students", "the Moon landing", "vaccines", "minimalism",
    "the Silk Road", "friendship", "a startup company", "the Amazon rainforest", "video games", "democracy",
    "a medieval castle", "nutrition for athletes", "the theory of evolution", "a road trip across Canada",
    "artificial intelligence in medicine", "the Great Wall of China", "a talking tree", "smartphones",
    "the importance of reading", "ocean pollution", "a wedding speech", "the solar system", "meditation",
    "a village festival", "quantum computers", "the Industrial Revolution", "penguins", "a science fair",
    "urban planning", "the Olympic Games", "a pirate ship", "cybersecurity", "Shakespeare", "desert life",
    "a customer complaint", "wind turbines", "the human brain", "a cooking competition", "world war one",
    "a museum at night", "typography", "the history of the internet", "a marathon", "a small island nation",
]

SEED_TEMPLATES = [
    # writing
    "Write a short story about {topic}", "Write a poem about {topic}", "Write a blog post about {topic}",
    "Write an email to my manager about", "Draft a formal letter", "Write a persuasive paragraph about {topic}",
    "Write a product description for", "Compose a haiku about {topic}", "Write a speech about {topic}",
    "Write a travel guide entry about", "Write a short dialogue between two friends about {topic}",
    # roleplay
    "Pretend you are a tour guide and", "Act as a personal trainer and", "Imagine you are a chef.",
    "You are a detective. ", "Role-play as a customer support agent:", "Pretend to be a famous scientist and",
    "Imagine you are a teacher explaining {topic} to children.",
    # reasoning
    "If a train leaves", "Which is heavier,", "Explain step by step why", "A farmer has", "Is it true that",
    "What would happen if", "Solve this riddle:", "There are three boxes.", "Who is older if",
    # math
    "What is the sum of", "Solve for x:", "Calculate the area of", "What is 15% of", "How many ways can",
    "Find the derivative of", "What is the probability that", "Simplify the expression", "Prove that",
    # coding
    "Write a Python function that", "Write a JavaScript function to", "How do I reverse a linked list in",
    "Explain what this code does:", "Write a SQL query that", "Fix the bug in this Python code:",
    "Implement a binary search in", "What is the difference between a list and a tuple in Python?",
    "Write a C++ program that", "How do I read a file line by line in",
    # extraction
    "Extract the names and dates from the following text:", "Summarize the following paragraph:",
    "List the main points of this text:", "Identify the countries mentioned in this sentence:",
    "From the following review, extract", "Convert this information into a table:",
    # STEM
    "Explain how {topic} works", "What causes", "Describe the process of", "Why is the sky",
    "What is the difference between", "How does a", "Explain the concept of",
    # humanities
    "What were the causes of", "Discuss the impact of {topic} on society", "Compare and contrast",
    "What can we learn from {topic}?", "Give me a brief history of {topic}", "What are the ethical issues of",
    # general advice / knowledge
    "Give me five tips for", "What are the benefits of", "How can I improve", "Can you recommend",
    "What are some ideas for", "Explain {topic} in simple terms", "What are the pros and cons of",
    "Plan a three-day trip to", "Help me prepare for", "What should I know about {topic}?",
]

FOLLOW_UP_SEEDS = [
    "Now rewrite your answer", "Can you make it shorter", "Explain the last point in more detail",
    "Now do the same for", "Summarize your answer in", "What are the drawbacks of", "Give me an example of",
    "Rewrite it as a poem", "Can you make it more formal", "Now explain it to a five-year-old",
    "What if", "Add a title", "Now write it from a different point of view", "Why", "Can you continue",
    "Turn it into a list", "Now change the ending", "How would this be different if", "",
]

FREE_PROMPT_FRACTION = 1 / 6


def synthesized_items(count: int, turns: int, seed: int) -> list[PromptItem]:
    """``count`` conversations whose user turns the target will write. The opening of each turn is drawn
    deterministically from the index (so a resumed run makes the same choices)."""
    items = []
    for index in range(count):
        rng = random.Random(seed * 1_000_003 + index)
        if rng.random() < FREE_PROMPT_FRACTION:
            first = ""
        else:
            first = rng.choice(SEED_TEMPLATES).format(topic=rng.choice(TOPICS))
        seeds = [first] + [rng.choice(FOLLOW_UP_SEEDS) for _ in range(turns - 1)]
        items.append(PromptItem(f"synth-{seed}-{index}", "synthesized", [None] * turns, None, seeds))
    return items


def clean_synthesized(seed: str, continuation: str, finished: bool) -> str | None:
    """The synthesized user message, or None when it is unusable (empty, cut without a sentence end)."""
    text = (seed + continuation).strip()
    if not finished:  # cut by the token limit: keep it up to the last sentence end
        cut = max(text.rfind(mark) for mark in (".", "?", "!", "\n", ":"))
        text = text[: cut + 1].strip() if cut > len(seed) // 2 else ""
    if len(text.split()) < 3:
        return None
    return text

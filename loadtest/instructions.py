"""A templated set of everyday chat instructions, split by subject into train and held out.

The draft is distilled on what the target writes in reply to chat requests, and its
acceptance is measured on chat requests it never saw. Both need many varied requests, and
no dataset can be downloaded here, so they are composed: a few templates per kind of
request (explain, compare, list, write, plan, code) crossed with subjects of that kind.

The split is by **subject**, not by instruction: every instruction about a held-out subject
is held out (``crc32(subject) % HELDOUT_EVERY == 0``), so an evaluation prompt never shares
its topic with a training prompt phrased another way. The order is fixed (kind, subject,
template), so the training data defined on it is reproducible.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import cache
from typing import Literal

Split = Literal["train", "heldout", "all"]
HELDOUT_EVERY = 5


@dataclass(frozen=True)
class Instruction:
    kind: str  # which subject list and templates it came from
    subject: str  # what the split hashes
    text: str


_TOPIC_TEMPLATES = (
    "Explain {} in simple terms.",
    "What is {}?",
    "Give me a short summary of {}.",
    "Explain {} to a ten-year-old.",
    "What are three common misconceptions about {}?",
    "Write a paragraph about {} for a school report.",
    "Why does {} matter?",
    "List five interesting facts about {}.",
    "How would you teach {} to a beginner?",
    "Write three quiz questions about {}, with answers.",
)
_TOPICS = (
    "photosynthesis",
    "the water cycle",
    "plate tectonics",
    "black holes",
    "gravity",
    "the immune system",
    "climate change",
    "inflation",
    "supply and demand",
    "the Roman Empire",
    "the French Revolution",
    "the Industrial Revolution",
    "the printing press",
    "electricity",
    "magnetism",
    "the theory of evolution",
    "DNA",
    "vaccines",
    "the solar system",
    "the Moon",
    "volcanoes",
    "earthquakes",
    "ocean tides",
    "rainbows",
    "the greenhouse effect",
    "renewable energy",
    "nuclear power",
    "the internet",
    "democracy",
    "the stock market",
    "compound interest",
    "sleep",
    "nutrition",
    "exercise",
    "meditation",
    "the human heart",
    "the brain",
    "memory",
    "bees",
    "coral reefs",
    "rainforests",
    "deserts",
    "glaciers",
    "the ancient Egyptians",
    "the Silk Road",
    "the Renaissance",
    "the Cold War",
    "jazz music",
    "impressionist painting",
    "the Olympic Games",
    "chess",
    "coffee",
    "bread baking",
    "recycling",
    "electric cars",
    "airplanes",
    "satellites",
    "GPS",
    "the metric system",
    "prime numbers",
    "probability",
    "statistics",
    "the Pythagorean theorem",
    "infinity",
)
_CONCEPT_TEMPLATES = (
    "Explain {} with a short Python example.",
    "What are common mistakes when using {}?",
    "When should I use {}, and when not?",
    "Write a short tutorial on {}.",
    "Compare {} with an alternative and say when each fits.",
)
_CONCEPTS = (
    "recursion",
    "hash tables",
    "linked lists",
    "binary trees",
    "dynamic programming",
    "big-O notation",
    "closures",
    "decorators in Python",
    "generators in Python",
    "list comprehensions",
    "exceptions",
    "unit testing",
    "mocking in tests",
    "git branches",
    "git rebase",
    "REST APIs",
    "HTTP status codes",
    "JSON",
    "regular expressions",
    "SQL joins",
    "database indexes",
    "transactions",
    "caching",
    "multithreading",
    "async/await",
    "the GIL in Python",
    "virtual environments",
    "type hints",
    "dataclasses",
    "inheritance",
    "composition over inheritance",
    "interfaces",
    "dependency injection",
    "design patterns",
    "the observer pattern",
    "garbage collection",
    "memory leaks",
    "floating-point numbers",
    "binary search",
    "sorting algorithms",
    "graphs and BFS",
    "Docker containers",
    "environment variables",
    "logging",
    "code review",
    "continuous integration",
)
_TASK_TEMPLATES = (
    "Write a Python function to {}.",
    "How do I {} in Python?",
    "Write a JavaScript function to {}.",
    "Explain step by step how to {}.",
    "Write a Python function to {}, with a docstring and a unit test.",
)
_TASKS = (
    "reverse a string",
    "check whether a number is prime",
    "count the words in a text",
    "find the largest element of a list",
    "remove duplicates from a list",
    "merge two sorted lists",
    "flatten a nested list",
    "compute the factorial of a number",
    "read a text file line by line",
    "write a dictionary to a JSON file",
    "parse a date string",
    "compute the average of numbers",
    "find the most common element in a list",
    "check if two strings are anagrams",
    "convert Celsius to Fahrenheit",
    "generate a random password",
    "validate an email address",
    "sort a list of tuples by the second item",
    "split a list into chunks",
    "compute the greatest common divisor",
    "convert a number to binary",
    "transpose a matrix",
    "find all files with a given extension in a folder",
    "download a web page",
    "count the vowels in a string",
    "capitalize every word in a sentence",
    "compute the Fibonacci numbers up to n",
    "check whether a string is a palindrome",
    "find the second largest number in a list",
    "rotate a list by k positions",
    "group words by their first letter",
    "compute the median of a list",
    "measure how long a function takes",
    "retry a failing function call",
    "parse command-line arguments",
    "read a CSV file into a list of dictionaries",
    "find the intersection of two lists",
    "implement a stack",
    "implement a queue",
    "compute the distance between two points",
    "format a number with thousands separators",
    "truncate a long string with an ellipsis",
    "convert a list of pairs into a dictionary",
    "check whether brackets in a string are balanced",
    "compute the running sum of a list",
)
_ACTIVITY_TEMPLATES = (
    "Give me some tips to {}.",
    "Write a step-by-step plan to {}.",
    "What should I avoid when I {}?",
    "Write a checklist to {}.",
)
_ACTIVITIES = (
    "plan a birthday party",
    "learn a new language",
    "prepare for a job interview",
    "start running",
    "save money each month",
    "organize my week",
    "sleep better",
    "write a good resume",
    "cook a healthy dinner",
    "start a vegetable garden",
    "prepare for an exam",
    "give a presentation",
    "move to a new city",
    "train a puppy",
    "read more books",
    "keep a journal",
    "reduce stress",
    "learn to play the guitar",
    "plan a road trip",
    "make new friends",
    "start a small business",
    "clean my house faster",
    "learn to program",
    "negotiate a salary",
    "host a dinner party",
    "travel on a budget",
    "take better photos",
    "stay focused while working from home",
    "learn to swim",
    "prepare for a marathon",
    "write a short story",
    "make a budget",
    "drink more water",
    "learn to cook rice",
    "teach a child to ride a bike",
    "improve my handwriting",
)
_WRITING_TEMPLATES = (
    "Write a short poem about {}.",
    "Write a haiku about {}.",
    "Write the opening paragraph of a story about {}.",
    "Write a short product description for {}.",
    "Write a friendly social media post about {}.",
)
_WRITING_SUBJECTS = (
    "the sea",
    "autumn leaves",
    "a rainy day",
    "a lost key",
    "a lighthouse",
    "the city at night",
    "an old bicycle",
    "a cup of tea",
    "the first snow",
    "a robot who learns to paint",
    "a library",
    "a mountain village",
    "a lonely astronaut",
    "a garden in spring",
    "a train journey",
    "a cat on a windowsill",
    "a forgotten letter",
    "a summer festival",
    "a new pair of running shoes",
    "a reusable water bottle",
    "a smart desk lamp",
    "a wooden chess set",
    "a hiking backpack",
    "a handmade candle",
    "a noise-cancelling headset",
    "a family recipe",
    "an old map",
    "a street musician",
    "a bakery at dawn",
    "a thunderstorm",
)
_EMAIL_RECIPIENTS = (
    "my manager",
    "a colleague",
    "a customer",
    "my landlord",
    "a teacher",
    "a new team member",
)
_EMAIL_MATTERS = (
    "a project deadline",
    "a meeting next week",
    "a late payment",
    "a broken heater",
    "a day off",
    "feedback on a report",
    "a welcome to the team",
    "a thank-you for their help",
    "a change in the schedule",
    "a question about an invoice",
)


def _compose() -> list[Instruction]:
    found: list[Instruction] = []
    groups = (
        ("topic", _TOPICS, _TOPIC_TEMPLATES),
        ("concept", _CONCEPTS, _CONCEPT_TEMPLATES),
        ("task", _TASKS, _TASK_TEMPLATES),
        ("activity", _ACTIVITIES, _ACTIVITY_TEMPLATES),
        ("writing", _WRITING_SUBJECTS, _WRITING_TEMPLATES),
    )
    for kind, subjects, templates in groups:
        for subject in subjects:
            found += [Instruction(kind, subject, t.format(subject)) for t in templates]
    for recipient in _EMAIL_RECIPIENTS:
        for matter in _EMAIL_MATTERS:
            text = f"Write a short, polite email to {recipient} about {matter}."
            found.append(Instruction("email", matter, text))
    return found


@cache
def _all() -> tuple[Instruction, ...]:
    return tuple(_compose())


def is_heldout(subject: str) -> bool:
    return zlib.crc32(subject.encode()) % HELDOUT_EVERY == 0


def instructions(split: Split = "all") -> list[Instruction]:
    """The instructions of a split, in their fixed order."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'heldout' or 'all'")
    found = _all()
    if split == "all":
        return list(found)
    return [i for i in found if is_heldout(i.subject) == (split == "heldout")]

"""Built-in openings for self-prompting (``--starter-set``): data only, so configs and CLI help read it cheaply.

The sets' openings are taken in turn together (a prompt begins with one and the target writes the rest; see
:mod:`eaglenest.extraction.self_prompts`). None is taken from an evaluation set.
"""

from __future__ import annotations

STARTER_SETS: dict[str, tuple[str, ...]] = {
    "kinds": (
        # writing
        "Write a short story about", "Compose a poem about", "Draft an email to", "Write a blog post about",
        "Write a persuasive essay on", "Write a product description for",
        # roleplay
        "Pretend you are", "Imagine you are a", "Act as a", "You are a detective who", "Role-play as",
        "Let's play a game where you are",
        # reasoning
        "If a", "A farmer has", "Which of these", "Solve this riddle:", "Explain the logic behind", "Is it true that",
        # math
        "Solve for x:", "What is the sum of", "Calculate the", "A train leaves", "Find the derivative of",
        "Prove that",
        # coding
        "Write a Python function that", "Write a JavaScript function to", "Fix the bug in this code:",
        "Implement a", "Write a SQL query that", "Explain what this code does:",
        # extraction
        "Extract the", "Summarize the following", "From the text below,", "List all the", "Given this table,",
        "Classify the following",
        # STEM
        "Explain how", "What is the difference between", "Describe the process of", "How does a", "What causes",
        "In physics,",
        # humanities and social science
        "Discuss the impact of", "Compare the", "What were the main causes of", "Analyze the themes of", "Who was",
        "How did the",
    ),
    "code": (
        # a function for the target to complete: it writes the signature and docstring, then answers with the body
        "Complete this Python function:\n\n```python\ndef",
        "Finish the implementation below so that it does what its docstring says.\n\n```python\ndef",
        "Write the body of this function. Reply with the code only.\n\n```python\ndef",
        "Implement the function below.\n\n```python\nfrom typing import List\n\n\ndef",
        "Fill in the missing code:\n\n```python\nclass",
        "Fix the bug in this Python function:\n\n```python\ndef",
        "Write a Python script that", "Write a Python class that", "Write pytest unit tests for a function that",
        "Write a JavaScript function that", "Write a regular expression that", "Write a Bash script that",
    ),
    "creative": (
        # writing and roleplay beyond ``kinds``' six each: the two kinds the drafters accept least on (offline on
        # 40 MT-Bench first turns, n8: writing 2.24, roleplay 2.31, reasoning 2.37, math 2.62 at steps 3)
        "Write a limerick about", "Write a dialogue between", "Continue this story:", "Write a letter from",
        "Write a speech for", "Write song lyrics about",
        "Stay in character as", "Respond as if you were", "You are a tour guide in", "Play the part of",
        "Speak as", "As a wizard in a fantasy world,",
    ),
}
"""Named sets of openings: ``kinds`` spreads prompts over the eight kinds MT-Bench groups its questions in;
``code`` asks for code, half of it a Python function to complete from a header the target writes (the shape of a
HumanEval request, none of its text), for drafters that lag on code; ``creative`` weighs writing and roleplay up,
the kinds drafters accept least on."""

STARTER_SETS_HELP = ("'kinds' (writing, roleplay, reasoning, math, coding, extraction, STEM, humanities: six openings "
                     "each), 'code' (functions to complete, scripts, queries), 'creative' (six more writing and six "
                     "more roleplay openings)")
"""What each set asks for, for the CLI's help and the configs' descriptions."""

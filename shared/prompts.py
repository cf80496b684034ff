"""Fixed prompt sets for demos and benchmarks (chat questions of varied length)."""

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is 12 times 12?",
    "Give me a short tip for learning to cook.",
    "Describe a cat to someone who has never seen one.",
    "Why do leaves change color in autumn? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "Write a two-line poem about coffee.",
    "What are the three states of water?",
    "Suggest a name for a friendly robot.",
    "How many days are there in a leap year?",
    "Explain what a computer program is to a child, using simple words and one example.",
    "What is the largest planet in our solar system?",
]

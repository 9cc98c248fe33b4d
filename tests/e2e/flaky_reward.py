"""A rule-based reward that fails on purpose for some answers (imported by name by the run's
driver and its reward worker processes)."""


def flaky_exact_match(completion: str, answer: str, prompt: str = "", **_) -> float:
    if answer == "3":
        raise RuntimeError("verifier crashed")
    if answer == "5":
        return "garbage"
    return 1.0 if completion.strip() == answer else 0.0

"""The numbers of compat/run-deepspeed-chat.sh's logs, one column per backend.

    python compat/deepspeed_chat_report.py OUT BACKEND...
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

PATTERNS = {  # log -> [(label, regex with one group per number)]
    "step1": [("step 1 eval loss (before, after)", r"ppl: \S+, loss: (\S+)")],
    "step2": [("step 2 epoch loss", r"Epoch 1/1 with loss (\S+)"),
              ("step 2 chosen score (after)", r"chosen_last_scores \(higher is better\) : (\S+),")],
    "step3-zero2": [("step 3 ZeRO-2 actor loss", r"Actor Loss: (\S+) \|"),
                    ("step 3 ZeRO-2 critic loss", r"Critic Loss: (\S+) \|"),
                    ("step 3 ZeRO-2 reward score", r"Average reward score: (\S+) \|")],
    "step3-zero3": [("step 3 ZeRO-3 actor loss", r"Actor Loss: (\S+) \|"),
                    ("step 3 ZeRO-3 critic loss", r"Critic Loss: (\S+) \|")],
    "step3-zero3-lora": [("step 3 ZeRO-3+LoRA actor loss", r"Actor Loss: (\S+) \|"),
                         ("step 3 ZeRO-3+LoRA critic loss", r"Critic Loss: (\S+) \|")],
}


def numbers(log: Path, regex: str) -> list[str]:
    if not log.exists():
        return []
    return [f"{float(m.rstrip(',')):.6f}" for m in re.findall(regex, log.read_text())]


def main(out: str, *backends: str) -> None:
    root = Path(out)
    print("| quantity | " + " | ".join(backends) + " |")
    print("|---|" + "---|" * len(backends))
    for log, rows in PATTERNS.items():
        for label, regex in rows:
            cells = [", ".join(numbers(root / b / f"{log}.log", regex)) or "-" for b in backends]
            print(f"| {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(*sys.argv[1:])

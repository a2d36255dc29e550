"""Generate a deterministic synthetic customer-service data set in the prompt/response/history format.

    python examples/chat/make_synthetic_data.py --out examples/chat/data --dialogues 600 --seed 0

Each dialogue is an outbound call to one persona (name, age, gender, province). The agent's
replies are a fixed function of the persona and of what the customer just said: the greeting
uses the surname and 先生/女士, the offer depends on the province and on the age band, the
closing depends on whether the customer accepts. One record per agent turn: ``prompt`` is the
customer's words followed by the persona fields, ``history`` the earlier turns.

``train.json`` and ``dev.json`` use disjoint personas (dev's full names never occur in train),
so the dev set measures whether the mapping was learned rather than memorised.
"""
from __future__ import annotations

import argparse
import json
import os
import random

SURNAMES = "张王李刘陈杨赵黄周吴徐孙马朱胡郭何林罗高"
GIVEN = "伟芳娜敏静丽强磊军洋勇艳杰娟涛明超秀霞平刚桂英华"
PROVINCES = ["湖北", "广东", "浙江", "江苏", "四川", "山东", "河南", "湖南", "北京", "上海", "福建", "安徽"]
YES = ["是。", "是的。", "对，我是。"]
NO = ["不是。", "你打错了。"]
WHAT = ["什么事。", "有什么事？", "你说吧。"]
WHICH = ["什么活动？", "说说看。", "什么优惠？"]
ACCEPT = ["怎么办理？", "好的，帮我办一个。"]
DECLINE = ["不需要。", "没兴趣，谢谢。"]


def persona_block(p: dict) -> str:
    return f"[姓名]:{p['name']}\n[年龄]:{p['age']:.1f}\n[性别]:{p['gender']}\n[省份]:{p['province']}"


def title(p: dict) -> str:
    return p["name"][0] + ("先生" if p["gender"] == "男士" else "女士")


def offer(p: dict) -> str:
    k = PROVINCES.index(p["province"])
    price = 10 + 5 * (k % 4)
    if p["age"] >= 60:
        return f"{p['province']}老用户关爱套餐，每月{price}元，含{100 * (1 + k % 3)}分钟通话。"
    return f"{p['province']}流量加油包，每月{price}元，含{5 * (1 + k % 3)}G流量。"


def dialogue(p: dict, rng: random.Random) -> list[tuple[str, str]]:
    """The (customer, agent) turns of one call; the first customer turn is empty (the agent calls)."""
    turns = [("", f"您好，请问是{title(p)}吗？")]
    if rng.random() < 0.1:
        return turns + [(rng.choice(NO), "抱歉打扰您了，再见。")]
    turns.append((rng.choice(YES), "喂，您好，我这是您专属客服顾问。"))
    turns.append((rng.choice(WHAT), f"打扰您了，给您介绍下{p['province']}近期的优惠活动？"))
    turns.append((rng.choice(WHICH), f"是{offer(p)}"))
    if rng.random() < 0.5:
        turns.append((rng.choice(ACCEPT), f"好的{title(p)}，已为您登记，稍后短信通知您。"))
    else:
        turns.append((rng.choice(DECLINE), "好的，不打扰您了，祝您生活愉快，再见。"))
    return turns


def records(p: dict, rng: random.Random) -> list[dict]:
    turns = dialogue(p, rng)
    out = []
    for i, (said, reply) in enumerate(turns):
        prompt = "\n".join(x for x in (said, persona_block(p)) if x)
        out.append({"prompt": prompt, "response": reply, "history": [list(t) for t in turns[:i]]})
    return out


def personas(n: int, rng: random.Random) -> list[dict]:
    seen: set[str] = set()
    out = []
    while len(out) < n:
        name = rng.choice(SURNAMES) + "".join(rng.choice(GIVEN) for _ in range(rng.choice((1, 2))))
        if name in seen:
            continue
        seen.add(name)
        out.append({"name": name, "age": float(rng.randint(20, 79)), "gender": rng.choice(["男士", "女士"]),
                    "province": rng.choice(PROVINCES)})
    return out


def make(out_dir: str, *, dialogues: int = 600, dev_dialogues: int = 40, seed: int = 0) -> tuple[str, str]:
    """Write ``train.json`` and ``dev.json`` (JSON lines) into ``out_dir``; return their paths."""
    rng = random.Random(seed)
    people = personas(dialogues + dev_dialogues, rng)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, group in (("train.json", people[:dialogues]), ("dev.json", people[dialogues:])):
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            for p in group:
                for r in records(p, rng):
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
        paths.append(path)
    return paths[0], paths[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dialogues", type=int, default=600)
    parser.add_argument("--dev_dialogues", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, dev = make(args.out, dialogues=args.dialogues, dev_dialogues=args.dev_dialogues, seed=args.seed)
    print(f"wrote {train} and {dev}")


if __name__ == "__main__":
    main()

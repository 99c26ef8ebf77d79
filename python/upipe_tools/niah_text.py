"""The text of `upipe eval --niah` in a model tokenizer's own tokens (upipe runs this).

usage: python3 -m upipe_tools.niah_text --tokenizer MODEL_DIR --out FILE.json --keys K1,K2,... [--haystack FILE]

For each key writes the needle sentence that states it, the question asked at the end of
the context, and the answer: the tokens of the key, split from the question's at the
key's first character of "QUESTION KEY" tokenized as one text (so that the tokens are
those the model reads there). Also writes the tokens the tokenizer's post-processor puts
before a text (the BOS, if any) and, unless the haystack comes from the user's data, the
built-in haystack: a plain text of its own, tokenized once (upipe repeats it to length).

Output: {"prefix": [...], "haystack": [...], "needles": [{"key", "needle", "question",
"answer"}, ...]}.
"""
import argparse
import json
import os
import sys

NEEDLE = " The secret number to remember is {key}. Keep it in mind. "
QUESTION = "\n\nQuestion: what is the secret number to remember? Answer: the secret number to remember is "

# The built-in haystack: plain prose of no particular subject, with no numbers in it.
HAYSTACK = """\
The town sat where two valleys met, and most mornings a low mist filled the lower streets
until the sun cleared the eastern ridge. People who lived there liked to say that the
weather changed its mind more often than the mayor did, which was saying a great deal.
In spring the orchards on the south slope turned white and then pink, and the bees from a
dozen hives worked them from dawn until the light went amber.

The market opened on the square twice a week. Farmers brought cheese wrapped in cloth,
jars of honey, baskets of early greens and late apples kept through the winter in cool
cellars. A baker sold long loaves with a crust that cracked when you pressed it, and a
woman from the hill farms sold wool in colours she dyed herself with onion skins, walnut
hulls and the roots of plants whose names she would not tell anyone.

Along the river a path ran under willows for most of the way to the next village. Anglers
stood in the shallows in the evening, and children skipped flat stones across the slow
water near the mill. The mill itself had not ground grain for many years; it was a
workshop now, where a carpenter made chairs and tables and, when asked nicely, repaired
the wooden toys that came to him with missing wheels and broken axles.

In summer the days grew long and warm, and the square filled with tables after dark.
Musicians played old tunes that everybody half remembered, and the older people danced
slowly while the younger ones talked about leaving for the city and, mostly, never did.
Storms came over the western hills in the late afternoons, loud and brief, and left the
stones of the streets steaming and the air smelling of wet earth and cut grass.

Autumn brought the harvest and the fairs. Carts loaded with pumpkins and sacks of grain
crowded the bridge, and the inn served a thick soup of beans and smoked pork that people
walked a long way to eat. The leaves on the ridge turned red and gold and then brown, and
the first frost silvered the fields one still morning while everyone was still asleep.

Winter was quiet. Snow closed the high road for weeks at a time, and the town turned
inward, to kitchens and workshops and the long table in the library where anyone could
sit and read by the stove. The librarian kept a ledger of every book borrowed, written in
a careful slanting hand, and she could tell you who had read what and whether they had
liked it, though she was far too discreet to do so unless you asked her directly.
"""


def bos_prefix(tok):
    """The ids the post-processor puts before a text's own ids (empty when it adds none)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return full[:start]
    return []


def question_and_answer(tok, key):
    text = QUESTION + key
    enc = tok.encode(text, add_special_tokens=False)
    first = next(i for i, (_, end) in enumerate(enc.offsets) if end > len(QUESTION))
    return enc.ids[:first], enc.ids[first:]


def main(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="model directory with tokenizer.json")
    p.add_argument("--out", required=True)
    p.add_argument("--keys", required=True, help="comma-separated keys (decimal digits)")
    p.add_argument("--no-haystack", action="store_true", help="the haystack comes from the user's data")
    a = p.parse_args(argv)
    path = os.path.join(a.tokenizer, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"upipe eval --niah: {path} is missing: the text needle needs the model's tokenizer "
                 "(or use --niah-vocab passkey for a model trained on the passkey task)")
    from tokenizers import Tokenizer  # noqa: PLC0415 (after the argument check)

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library's own error type: one line, never a traceback
        sys.exit(f"upipe eval --niah: {path} is not a tokenizer the tokenizers library reads ({e}); restore the "
                 "model's tokenizer.json (or use --niah-vocab passkey for a model trained on the passkey task)")
    needles = []
    for key in a.keys.split(","):
        if not key.isdigit():
            sys.exit(f"niah_text.py: key {key!r} is not decimal digits")
        question, answer = question_and_answer(tok, key)
        needles.append({"key": key, "needle": tok.encode(NEEDLE.format(key=key), add_special_tokens=False).ids,
                        "question": question, "answer": answer})
    out = {"prefix": bos_prefix(tok), "needles": needles,
           "haystack": [] if a.no_haystack else tok.encode(HAYSTACK, add_special_tokens=False).ids}
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1:])

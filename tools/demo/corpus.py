#!/usr/bin/env python3
"""Seeded generator of the synthetic corpus for the k3 demo model.

    python3 tools/demo/corpus.py --out /tmp/demo/corpus.jsonl --n 200000 --seed 1
    python3 tools/demo/corpus.py --heldout tests/fixtures/demo/heldout.json

Every record is one JSON line:
  {"kind": "chat", "thinking": bool, "effort": "max"|"low"|"high", "messages": [...]}
      messages: {"role": "system"|"user"|"assistant", "content": str, "reasoning"?: str}
      The whole conversation (ending with an assistant turn) is rendered by
      `render_segments` below exactly as src/session/template.rs renders it.
  {"kind": "raw", "text": str}
      plain text (simple sentences, short stories, facts as statements), no template.

Content: greetings and small talk; a fixed knowledge set (capitals of 100 countries, colours of
common things, opposites, next/previous day and month, one- and two-digit addition and
subtraction); multi-turn dialogues in which the user states a name, a favourite number or a
favourite colour and asks for it one or more turns later; raw text.

Held out (never generated for training; `check_record` enforces it on every record):
  * arithmetic pairs in HELDOUT_ADD (both orders) and HELDOUT_SUB,
  * (template, entity) combinations in the fact question tables (HELDOUT_COMBOS),
  * the recall names/numbers of the 10 test conversations,
  * the raw-mode test sentences.
`--heldout PATH` writes the 50 fact questions, the 10 recall conversations and the raw prompts
with their expected answers.
"""

import argparse
import json
import random
import re
import sys

# ---------------------------------------------------------------------------------------------
# Chat template (mirror of src/session/template.rs)
# ---------------------------------------------------------------------------------------------

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"


def effort_body(effort):
    return ("`thinking_effort` guides on how much to think in your thinking channel (not "
            "including the response channel), supported values include `low`, `medium`, "
            "`high`, and `max`.\nNow the system is invoked with `thinking_effort=" + effort + "`.")


def _is_py_space_only(s):
    return all(c.isspace() for c in s)


def render_segments(messages, thinking, effort="max", add_generation_prompt=False):
    """List of (text, allow_special) exactly as template.rs `render_segments`."""
    segs = []

    def control(m):
        segs.append((m, True))

    def text(t):
        if t:
            segs.append((t, False))

    def esc(v):
        return v.replace("&", "&amp;").replace('"', "&quot;")

    def open_tag(tag, attrs=()):
        control(OPEN)
        text(tag)
        for k, v in attrs:
            text(" " + k)
            text('="')
            text(esc(v))
            text('"')
        control(SEP)

    def close_tag(tag):
        control(CLOSE)
        text(tag)
        control(SEP)

    def message(attrs, body):
        open_tag("message", attrs)
        text(body)
        close_tag("message")
        control(END_OF_MSG)

    if thinking:
        message([("role", "system"), ("type", "thinking-effort")], effort_body(effort))
    for m in messages:
        r = m["role"]
        if r in ("system", "user"):
            message([("role", r)], m["content"])
        elif r == "assistant":
            open_tag("message", [("role", "assistant")])
            if thinking:
                open_tag("think")
                rs = m.get("reasoning")
                if rs is not None and not _is_py_space_only(rs):
                    text(rs)
                close_tag("think")
            open_tag("response")
            text(m["content"])
            close_tag("response")
            close_tag("message")
            control(END_OF_MSG)
        else:
            raise ValueError(r)
    if add_generation_prompt:
        open_tag("message", [("role", "assistant")])
        open_tag("think" if thinking else "response")
    return segs


# ---------------------------------------------------------------------------------------------
# Knowledge
# ---------------------------------------------------------------------------------------------

CAPITALS = [
    ("Afghanistan", "Kabul"), ("Albania", "Tirana"), ("Algeria", "Algiers"),
    ("Argentina", "Buenos Aires"), ("Armenia", "Yerevan"), ("Australia", "Canberra"),
    ("Austria", "Vienna"), ("Azerbaijan", "Baku"), ("Bangladesh", "Dhaka"), ("Belarus", "Minsk"),
    ("Belgium", "Brussels"), ("Brazil", "Brasilia"), ("Bulgaria", "Sofia"),
    ("Cambodia", "Phnom Penh"), ("Canada", "Ottawa"), ("Chile", "Santiago"), ("China", "Beijing"),
    ("Colombia", "Bogota"), ("Croatia", "Zagreb"), ("Cuba", "Havana"),
    ("Denmark", "Copenhagen"), ("Ecuador", "Quito"), ("Egypt", "Cairo"), ("Estonia", "Tallinn"),
    ("Ethiopia", "Addis Ababa"), ("Finland", "Helsinki"), ("France", "Paris"),
    ("Georgia", "Tbilisi"), ("Germany", "Berlin"), ("Ghana", "Accra"), ("Greece", "Athens"),
    ("Hungary", "Budapest"), ("Iceland", "Reykjavik"), ("India", "New Delhi"),
    ("Indonesia", "Jakarta"), ("Iran", "Tehran"), ("Iraq", "Baghdad"), ("Ireland", "Dublin"),
    ("Italy", "Rome"), ("Jamaica", "Kingston"), ("Japan", "Tokyo"), ("Jordan", "Amman"),
    ("Kazakhstan", "Astana"), ("Kenya", "Nairobi"), ("Laos", "Vientiane"), ("Latvia", "Riga"),
    ("Lebanon", "Beirut"), ("Libya", "Tripoli"), ("Lithuania", "Vilnius"),
    ("Madagascar", "Antananarivo"), ("Malaysia", "Kuala Lumpur"), ("Mali", "Bamako"),
    ("Malta", "Valletta"), ("Mexico", "Mexico City"), ("Mongolia", "Ulaanbaatar"),
    ("Morocco", "Rabat"), ("Mozambique", "Maputo"), ("Nepal", "Kathmandu"),
    ("the Netherlands", "Amsterdam"), ("New Zealand", "Wellington"), ("Nicaragua", "Managua"),
    ("Nigeria", "Abuja"), ("Norway", "Oslo"), ("Oman", "Muscat"), ("Pakistan", "Islamabad"),
    ("Paraguay", "Asuncion"), ("Peru", "Lima"), ("the Philippines", "Manila"),
    ("Poland", "Warsaw"), ("Portugal", "Lisbon"), ("Qatar", "Doha"), ("Romania", "Bucharest"),
    ("Russia", "Moscow"), ("Rwanda", "Kigali"), ("Saudi Arabia", "Riyadh"), ("Senegal", "Dakar"),
    ("Serbia", "Belgrade"), ("Slovakia", "Bratislava"), ("Slovenia", "Ljubljana"),
    ("Somalia", "Mogadishu"), ("South Korea", "Seoul"), ("Spain", "Madrid"),
    ("Sudan", "Khartoum"), ("Sweden", "Stockholm"), ("Switzerland", "Bern"),
    ("Syria", "Damascus"), ("Tanzania", "Dodoma"), ("Thailand", "Bangkok"), ("Tunisia", "Tunis"),
    ("Turkey", "Ankara"), ("Uganda", "Kampala"), ("Ukraine", "Kyiv"),
    ("the United Kingdom", "London"), ("the United States", "Washington"),
    ("Uruguay", "Montevideo"), ("Uzbekistan", "Tashkent"), ("Venezuela", "Caracas"),
    ("Vietnam", "Hanoi"), ("Zambia", "Lusaka"), ("Zimbabwe", "Harare"),
]
assert len(CAPITALS) == 100 and len({c for c, _ in CAPITALS}) == 100

# (noun phrase as used in a question, colour)
COLOURS_OF = [
    ("the sky", "blue"), ("grass", "green"), ("snow", "white"), ("a banana", "yellow"),
    ("coal", "black"), ("blood", "red"), ("a strawberry", "red"), ("a lemon", "yellow"),
    ("a carrot", "orange"), ("milk", "white"), ("chocolate", "brown"), ("a tomato", "red"),
    ("a cherry", "red"), ("a lime", "green"), ("a leaf", "green"), ("a frog", "green"),
    ("the sun", "yellow"), ("a cloud", "white"), ("the sea", "blue"), ("the ocean", "blue"),
    ("a pumpkin", "orange"), ("an eggplant", "purple"), ("a grape", "purple"),
    ("a violet", "purple"), ("salt", "white"), ("a crow", "black"), ("a flamingo", "pink"),
    ("a pig", "pink"), ("an elephant", "grey"), ("a mouse", "grey"), ("corn", "yellow"),
    ("a fire truck", "red"), ("a polar bear", "white"), ("broccoli", "green"),
    ("a cucumber", "green"), ("a ruby", "red"), ("a sapphire", "blue"), ("an emerald", "green"),
    ("ash", "grey"), ("chalk", "white"), ("coffee", "brown"), ("soil", "brown"),
    ("a chick", "yellow"), ("a raven", "black"),
]

OPPOSITE_PAIRS = [
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("light", "dark"), ("open", "closed"), ("full", "empty"), ("wet", "dry"), ("hard", "soft"),
    ("high", "low"), ("long", "short"), ("rich", "poor"), ("strong", "weak"), ("early", "late"),
    ("left", "right"), ("in", "out"), ("day", "night"), ("good", "bad"), ("yes", "no"),
    ("on", "off"), ("loud", "quiet"), ("thick", "thin"), ("clean", "dirty"), ("push", "pull"),
    ("win", "lose"), ("buy", "sell"), ("first", "last"), ("inside", "outside"),
    ("above", "below"), ("before", "after"), ("true", "false"), ("young", "old"),
    ("begin", "end"), ("north", "south"), ("east", "west"), ("sweet", "sour"),
    ("love", "hate"), ("question", "answer"), ("friend", "enemy"), ("laugh", "cry"),
    ("come", "go"), ("give", "take"), ("boy", "girl"), ("near", "far"),
]
OPPOSITES = {}
for _a, _b in OPPOSITE_PAIRS:
    assert _a not in OPPOSITES and _b not in OPPOSITES
    OPPOSITES[_a], OPPOSITES[_b] = _b, _a

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]

FAV_COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "pink", "black", "white",
               "brown", "grey", "gold", "silver", "teal", "violet", "turquoise", "maroon",
               "navy", "cyan", "magenta", "beige", "indigo", "lavender", "crimson"]

# ---------------------------------------------------------------------------------------------
# Question templates. Each fact kind has templates; a held-out set of (template index, entity)
# combinations is never generated for training.
# ---------------------------------------------------------------------------------------------

CAPITAL_Q = [
    "What is the capital of {c}?",
    "What's the capital of {c}?",
    "Which city is the capital of {c}?",
    "Tell me the capital of {c}.",
    "Name the capital of {c}.",
    "Do you know the capital of {c}?",
    "What city is the capital of {c}?",
    "capital of {c}?",
    "Can you tell me the capital of {c}?",
    "I wonder what the capital of {c} is.",
]
COLOUR_Q = [
    "What colour is {x}?",
    "What color is {x}?",
    "What is the colour of {x}?",
    "Tell me the colour of {x}.",
    "Which colour is {x}?",
    "Do you know what colour {x} is?",
    "What is the color of {x}?",
]
OPPOSITE_Q = [
    "What is the opposite of {w}?",
    "What's the opposite of {w}?",
    "Tell me the opposite of {w}.",
    "What is the opposite of the word {w}?",
    "Give me the opposite of {w}.",
    "Which word is the opposite of {w}?",
]
DAY_NEXT_Q = [
    "What day comes after {d}?",
    "What day is after {d}?",
    "Which day follows {d}?",
    "What is the day after {d}?",
    "If today is {d}, what day is tomorrow?",
]
DAY_PREV_Q = [
    "What day comes before {d}?",
    "What day is before {d}?",
    "Which day comes right before {d}?",
    "What is the day before {d}?",
    "If today is {d}, what day was yesterday?",
]
MONTH_NEXT_Q = [
    "What month comes after {m}?",
    "What month is after {m}?",
    "Which month follows {m}?",
    "What is the month after {m}?",
]
MONTH_PREV_Q = [
    "What month comes before {m}?",
    "What month is before {m}?",
    "Which month comes right before {m}?",
    "What is the month before {m}?",
]
ADD_Q = [
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "How much is {a} plus {b}?",
    "Add {a} and {b}.",
    "What do you get if you add {a} and {b}?",
    "What is the sum of {a} and {b}?",
    "Can you add {a} and {b}?",
    "{a} plus {b}?",
    "Please compute {a} + {b}.",
]
SUB_Q = [
    "What is {a} minus {b}?",
    "What is {a} - {b}?",
    "How much is {a} minus {b}?",
    "Subtract {b} from {a}.",
    "What is {a} take away {b}?",
    "What do you get if you subtract {b} from {a}?",
    "{a} minus {b}?",
    "Please compute {a} - {b}.",
]


def capital_answer(c, cap):
    return f"The capital of {c} is {cap}."


def colour_answer(x, col):
    return f"{x[0].upper() + x[1:]} is {col}."


def opposite_answer(w):
    return f"The opposite of {w} is {OPPOSITES[w]}."


def day_answer(d, nxt):
    i = DAYS.index(d)
    if nxt:
        return f"The day after {d} is {DAYS[(i + 1) % 7]}.", DAYS[(i + 1) % 7]
    return f"The day before {d} is {DAYS[(i - 1) % 7]}.", DAYS[(i - 1) % 7]


def month_answer(m, nxt):
    i = MONTHS.index(m)
    if nxt:
        return f"The month after {m} is {MONTHS[(i + 1) % 12]}.", MONTHS[(i + 1) % 12]
    return f"The month before {m} is {MONTHS[(i - 1) % 12]}.", MONTHS[(i - 1) % 12]


# --- held-out sets -----------------------------------------------------------------------------

HELDOUT_ADD = [(7, 5), (3, 9), (8, 6), (6, 4), (2, 8), (47, 38), (23, 19), (56, 27), (64, 35),
               (15, 82), (91, 8), (38, 44), (72, 66), (19, 9), (85, 13)]
HELDOUT_SUB = [(9, 4), (8, 3), (7, 7), (15, 6), (13, 8), (64, 27), (92, 45), (81, 39), (58, 12),
               (70, 24), (99, 48), (46, 18), (33, 7), (87, 59), (50, 25)]
HELDOUT_ADD_SET = {(a, b) for a, b in HELDOUT_ADD} | {(b, a) for a, b in HELDOUT_ADD}
HELDOUT_SUB_SET = set(HELDOUT_SUB)

# (kind, template index, entity) — entity strings as in the tables above
HELDOUT_COMBOS = {
    ("capital", 0, "Peru"), ("capital", 0, "Kenya"), ("capital", 1, "Norway"),
    ("capital", 2, "Japan"), ("capital", 2, "Egypt"), ("capital", 3, "Canada"),
    ("capital", 4, "Vietnam"), ("capital", 5, "Portugal"), ("capital", 6, "Hungary"),
    ("capital", 0, "Argentina"), ("capital", 8, "Malaysia"), ("capital", 0, "Finland"),
    ("capital", 2, "Chile"), ("capital", 0, "France"),
    ("colour", 0, "the sky"), ("colour", 1, "a banana"), ("colour", 2, "grass"),
    ("colour", 0, "a carrot"), ("colour", 3, "coal"), ("colour", 4, "an eggplant"),
    ("opposite", 0, "hot"), ("opposite", 1, "fast"), ("opposite", 2, "full"),
    ("opposite", 0, "loud"), ("opposite", 5, "early"),
    ("day_next", 0, "Monday"), ("day_prev", 1, "Friday"), ("month_next", 2, "March"),
    ("month_prev", 0, "October"), ("month_next", 0, "July"),
}
HELDOUT_TEMPLATES = {
    "capital": CAPITAL_Q, "colour": COLOUR_Q, "opposite": OPPOSITE_Q, "day_next": DAY_NEXT_Q,
    "day_prev": DAY_PREV_Q, "month_next": MONTH_NEXT_Q, "month_prev": MONTH_PREV_Q,
}

# recall test conversations: names / numbers / colours never stated by a user in training
HELDOUT_NAMES = ["Ada", "Bartholomew", "Quentin", "Rosalind", "Thaddeus", "Wilhelmina"]
HELDOUT_NUMBERS = ["4817", "392", "76", "1504"]
HELDOUT_RAW_PROMPTS = [
    "Once upon a time, there was a tiny turtle named",
    "The yellow duck swam across the",
    "Every morning, the old farmer",
    "The capital of Peru is Lima. The capital of Kenya is",
    "A little girl named Mia found a shiny",
]

# ---------------------------------------------------------------------------------------------
# Names, small talk, stories
# ---------------------------------------------------------------------------------------------

TRAIN_NAMES = [
    "Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Isabel", "Jack",
    "Karen", "Liam", "Maria", "Noah", "Olivia", "Peter", "Quinn", "Rachel", "Sam", "Tom",
    "Uma", "Victor", "Wendy", "Xavier", "Yara", "Zoe", "Anna", "Ben", "Chloe", "Daniel",
    "Ella", "Finn", "George", "Hannah", "Ivan", "Julia", "Kevin", "Laura", "Max", "Nina",
    "Oscar", "Paula", "Ryan", "Sara", "Tim", "Ursula", "Vera", "Will", "Yusuf", "Zara",
    "Amir", "Bianca", "Carlos", "Diana", "Elena", "Felix", "Gina", "Hugo", "Iris", "Jonas",
    "Kim", "Leo", "Mia", "Nora", "Omar", "Priya", "Raj", "Sofia", "Theo", "Lucas", "Mateo",
    "Aisha", "Bruno", "Clara", "Dev", "Esther", "Fatima", "Gustav", "Hiro", "Ines", "Jamal",
    "Kenji", "Lena", "Marco", "Nadia", "Otto", "Pablo", "Rosa", "Simon", "Tara", "Ulrich",
    "Valentina", "Walter", "Yuki", "Zain", "Alex", "Charlie", "Jordan", "Robin", "Kai",
    "Luna", "Ruby", "Ivy", "Jasper", "Milo", "Hazel", "Ezra", "Stella", "Arthur", "Freya",
    "Oliver", "Sophie", "James", "Lily", "Ethan", "Amelia", "Mason", "Harper", "Logan",
    "Aria", "Elijah", "Chen", "Wei", "Mei", "Ravi", "Anika", "Sven", "Astrid", "Pierre",
    "Camille", "Dmitri", "Olga", "Kofi", "Ama", "Tariq", "Layla", "Mohammed", "Sana",
]
SYL_A = ["ba", "be", "bo", "da", "de", "di", "fa", "ga", "go", "ha", "ja", "jo", "ka", "ke",
         "ki", "la", "le", "li", "lo", "ma", "me", "mi", "mo", "na", "ne", "ni", "no", "pa",
         "pe", "ra", "re", "ri", "ro", "sa", "se", "si", "so", "ta", "te", "ti", "to", "va",
         "ve", "vi", "wa", "ya", "za", "zo", "al", "an", "ar", "el", "en", "er", "il", "in",
         "or", "ul", "ash", "bri", "cla", "dra", "fre", "gri", "kro", "pla", "sha", "sti",
         "tho", "tri", "qua", "wil", "xan", "yor", "zen", "mar", "lin", "dor", "bel", "ros"]
SYL_END = ["", "", "", "n", "r", "l", "s", "th", "x", "ck", "m", "nd", "ra", "na", "la", "ia",
           "o", "us", "en", "ette", "win", "bert", "lyn", "ford", "mond", "rik"]
_HELDOUT_NAME_SET = {n.lower() for n in HELDOUT_NAMES}


MORE_NAMES = [
    "Abigail", "Adrian", "Agnes", "Albert", "Alfred", "Alma", "Amos", "Angela", "Anton", "Apollo",
    "Archibald", "Arnold", "Augustin", "Aurora", "Barnaby", "Beatrice", "Benedict", "Bernard",
    "Bertha", "Blanche", "Boris", "Brigitte", "Caspar", "Cecilia", "Cedric", "Clarence",
    "Claudia", "Cornelius", "Cyril", "Dagmar", "Delphine", "Desmond", "Dorothea", "Edgar",
    "Edmund", "Eleanor", "Elias", "Eloise", "Emeric", "Ernest", "Eugenia", "Evander", "Fabian",
    "Felicity", "Ferdinand", "Florian", "Frederica", "Gabriel", "Genevieve", "Gertrude",
    "Gideon", "Gilbert", "Godfrey", "Gwendolyn", "Harold", "Helga", "Horace", "Ignatius",
    "Imogen", "Ingrid", "Isadora", "Jacqueline", "Jeremiah", "Josephine", "Juniper", "Leopold",
    "Lorenzo", "Lucinda", "Magdalena", "Marcellus", "Matilda", "Maximilian", "Melchior",
    "Mildred", "Montgomery", "Nathaniel", "Octavia", "Ophelia", "Oswald", "Penelope",
    "Percival", "Philippa", "Prudence", "Reginald", "Rupert", "Sebastian", "Seraphina",
    "Sigmund", "Sylvester", "Theodora", "Tobias", "Ulysses", "Valerian", "Winifred",
    "Zachariah", "Zenobia", "Ignacio", "Mortimer", "Cordelia", "Leontine", "Hyacinth",
]
_VOW = "aeiouy"
_CON = "bcdfghjklmnpqrstvwxz"
_CLUST = ["br", "ch", "cl", "dr", "fl", "gr", "kr", "ph", "pr", "sh", "st", "th", "tr", "wh",
          "sk", "sl", "sn", "qu", "ll", "nn", "rr", "ss", "tt", "ck", "nd", "rt", "lm", "x", "z"]


def pseudo_name(rng):
    """A made-up name: random letters in consonant/vowel patterns (every letter of the
    alphabet occurs), so the names split into many different BPE pieces."""
    while True:
        n = []
        length = rng.choice([3, 4, 5, 5, 6, 6, 7, 8, 9, 10])
        vowel = rng.random() < 0.35
        while sum(len(x) for x in n) < length:
            if vowel:
                n.append(rng.choice(_VOW) if rng.random() < 0.85 else rng.choice(["ea", "io", "ou", "ai", "ee"]))
            else:
                n.append(rng.choice(_CON) if rng.random() < 0.8 else rng.choice(_CLUST))
            vowel = not vowel
        name = "".join(n)
        if name.lower() not in _HELDOUT_NAME_SET:
            return name[0].upper() + name[1:]


def syllable_name(rng):
    while True:
        n = "".join(rng.choice(SYL_A) for _ in range(rng.choice([1, 2, 2, 2, 3]))) + rng.choice(SYL_END)
        if 3 <= len(n) <= 11 and n.lower() not in _HELDOUT_NAME_SET:
            return n[0].upper() + n[1:]


def blend_name(rng):
    """A made-up name spliced from pieces of real words (names, countries, capitals, animals):
    its BPE pieces are the many multi-letter pieces of ordinary words, which a name copier must
    carry as faithfully as single letters."""
    while True:
        parts = []
        for i in range(rng.choice([2, 2, 3, 3, 4])):
            w = rng.choice(_BLEND_POOL)
            n = rng.randint(2, min(5, len(w)))
            s0 = 0 if i == 0 and rng.random() < 0.6 else rng.randrange(0, len(w) - n + 1)
            parts.append(w[s0:s0 + n])
        name = "".join(parts)
        if 3 <= len(name) <= 12 and name not in _HELDOUT_NAME_SET:
            return name[0].upper() + name[1:]


# share of names drawn by `any_name` from `blend_name` (set by `generate`; 0 keeps the
# random stream of recipes that predate it unchanged)
BLEND_SHARE = 0.0


def any_name(rng):
    if BLEND_SHARE and rng.random() < BLEND_SHARE:
        return blend_name(rng)
    k = rng.random()
    if k < 0.2:
        return rng.choice(TRAIN_NAMES)
    if k < 0.35:
        return rng.choice(MORE_NAMES)
    if k < 0.55:
        return syllable_name(rng)
    return pseudo_name(rng)


def fav_number(rng):
    while True:
        k = rng.choice([1, 2, 2, 3, 3, 4])
        n = str(rng.randrange(10 ** (k - 1) if k > 1 else 0, 10 ** k))
        if n not in HELDOUT_NUMBERS:
            return n


ANIMALS = ["cat", "dog", "rabbit", "fox", "bear", "mouse", "owl", "duck", "horse", "lion",
           "turtle", "frog", "bird", "pig", "goat", "sheep", "cow", "squirrel", "deer", "wolf",
           "hedgehog", "kitten", "puppy", "penguin", "elephant", "monkey", "tiger", "goose"]
ADJS = ["little", "big", "happy", "brave", "small", "old", "young", "kind", "clever", "sleepy",
        "tiny", "funny", "quiet", "curious", "friendly", "shy", "busy", "gentle", "tall", "lazy"]
COLOUR_ADJS = ["red", "blue", "green", "yellow", "brown", "white", "black", "orange", "purple",
               "pink", "grey", "golden", "silver"]
PLACES = ["forest", "village", "garden", "farm", "town", "house by the river", "small house",
          "big city", "meadow", "cave", "castle", "park", "valley", "hill", "barn"]
LANDMARKS = ["river", "lake", "old tree", "mountain", "sea", "bridge", "school", "market",
             "big rock", "pond", "road", "church", "mill"]
OBJECTS = ["ball", "box", "key", "hat", "book", "stone", "apple", "kite", "shell", "coin",
           "flower", "map", "cup", "ring", "feather", "bell", "basket", "lamp", "boat", "letter"]
ACTIVITIES = ["play in the grass", "run by the river", "read books", "sing songs",
              "look at the stars", "eat apples", "climb trees", "swim in the lake",
              "help his friends", "draw pictures", "dance in the rain", "walk in the park",
              "bake bread", "fly a kite", "pick flowers", "sleep in the sun"]
EMOTIONS = ["happy", "surprised", "excited", "curious", "glad", "proud", "amazed"]
FRIENDS = ["friend", "mother", "father", "brother", "sister", "grandmother", "teacher",
           "neighbour"]
FOODS = ["bread", "soup", "cake", "apples", "rice", "cheese", "pie", "eggs", "fish", "carrots"]
_BLEND_POOL = sorted({w.lower() for w in TRAIN_NAMES + MORE_NAMES + ANIMALS + OBJECTS
                      + [c for pair in CAPITALS for c in pair] if w.isalpha() and len(w) >= 3})
VERBS_PAST = ["walked", "ran", "jumped", "looked", "sat", "slept", "played", "danced", "waited",
              "sang", "swam"]
PREPS = ["to", "near", "under", "behind", "by", "in", "across", "over", "around", "into"]
SCENES = ["tree", "house", "river", "lake", "garden", "road", "hill", "bridge", "table",
          "window", "door", "field", "fence", "pond", "park", "market", "school"]
TIMES = ["In the morning", "At night", "After lunch", "On Sunday", "In the evening",
         "Every day", "In the summer", "In the winter", "Yesterday", "Today"]


PEOPLE = ["farmer", "baker", "fisherman", "king", "queen", "girl", "boy", "doctor", "painter",
          "sailor"]
# share of story heroes and sentence subjects that are people, not animals (set by `generate`;
# 0 keeps the random stream of recipes that predate it unchanged)
PEOPLE_SHARE = 0.0


def hero_noun(rng):
    if PEOPLE_SHARE and rng.random() < PEOPLE_SHARE:
        return rng.choice(PEOPLE)
    return rng.choice(ANIMALS)


def story(rng):
    hero = hero_noun(rng)
    name = any_name(rng)
    he, his = rng.choice([("he", "his"), ("she", "her")])
    He = he.capitalize()
    s = [rng.choice([
        f"Once upon a time, there was a {rng.choice(ADJS)} {hero} named {name}.",
        f"There was once a {rng.choice(ADJS)} {hero} called {name}.",
        f"Long ago, a {rng.choice(ADJS)} {hero} named {name} lived in a {rng.choice(PLACES)}.",
    ])]
    s.append(rng.choice([
        f"{name} lived in a {rng.choice(PLACES)} near the {rng.choice(LANDMARKS)}.",
        f"Every day, {he} liked to {rng.choice(ACTIVITIES)}.",
        f"{He} had a {rng.choice(COLOUR_ADJS)} {rng.choice(OBJECTS)} that {he} loved very much.",
    ]))
    obj = rng.choice(OBJECTS)
    s.append(rng.choice([
        f"One day, {name} found a {rng.choice(COLOUR_ADJS)} {obj} near the {rng.choice(LANDMARKS)}.",
        f"One morning, {name} saw a {rng.choice(ADJS)} {rng.choice(ANIMALS)} by the {rng.choice(LANDMARKS)}.",
        f"One day, {his} {rng.choice(FRIENDS)} lost a {obj}.",
    ]))
    s.append(rng.choice([
        f"{He} was very {rng.choice(EMOTIONS)}.",
        f"{name} wanted to help, so {he} looked everywhere.",
        f"{He} asked {his} {rng.choice(FRIENDS)} what to do.",
        f"{He} took it home and showed it to {his} {rng.choice(FRIENDS)}.",
    ]))
    if rng.random() < 0.7:
        s.append(rng.choice([
            f"Together they ate {rng.choice(FOODS)} and laughed.",
            f"In the end, everyone was {rng.choice(EMOTIONS)}.",
            f"From that day on, {name} was never sad again.",
            f"That night, {name} slept with a big smile.",
            f"And they all lived happily ever after.",
        ]))
    return " ".join(s)


def simple_sentence(rng):
    k = rng.random()
    if k < 0.35:
        return (f"The {rng.choice(ADJS)} {hero_noun(rng)} {rng.choice(VERBS_PAST)} "
                f"{rng.choice(PREPS)} the {rng.choice(SCENES)}.")
    if k < 0.55:
        when = rng.choice(TIMES)
        if PEOPLE_SHARE and rng.random() < PEOPLE_SHARE:
            who = f"the {rng.choice(ADJS)} {rng.choice(PEOPLE)}"
        else:
            who = any_name(rng)
        return f"{when}, {who} {rng.choice(VERBS_PAST)} {rng.choice(PREPS)} the {rng.choice(SCENES)}."
    if k < 0.7:
        return f"{any_name(rng)} has a {rng.choice(COLOUR_ADJS)} {rng.choice(OBJECTS)}."
    if k < 0.85:
        return f"The {rng.choice(ANIMALS)} likes to {rng.choice(ACTIVITIES)}."
    return f"{any_name(rng)} and {any_name(rng)} ate {rng.choice(FOODS)} by the {rng.choice(LANDMARKS)}."


# small talk: (user variants, assistant variants)
SMALL_TALK = [
    (["Hi!", "Hello!", "Hey!", "Hi there!", "Hello there!", "hi", "hello", "Hey there!",
      "Greetings!", "Hiya!"],
     ["Hello! How can I help you today?", "Hi! What would you like to know?",
      "Hello! Nice to see you.", "Hi there! How can I help?"]),
    (["Good morning!", "Good morning."], ["Good morning! How can I help you today?"]),
    (["Good afternoon!"], ["Good afternoon! How can I help you?"]),
    (["Good evening!"], ["Good evening! How can I help you?"]),
    (["How are you?", "How are you doing?", "How are you today?", "How is it going?",
      "How's it going?"],
     ["I am doing well, thank you! How are you?", "I am fine, thanks for asking! How about you?"]),
    (["I am fine.", "I'm good, thanks.", "I am good.", "I'm fine, thank you.", "Doing well!",
      "Pretty good."],
     ["Glad to hear that!", "That is great to hear!"]),
    (["Thank you!", "Thanks!", "Thanks a lot!", "Thank you very much.", "thanks"],
     ["You're welcome!", "You are welcome! Happy to help."]),
    (["Goodbye!", "Bye!", "See you later!", "Bye bye!", "Goodbye."],
     ["Goodbye! Have a nice day!", "Bye! Take care."]),
    (["Good night!"], ["Good night! Sleep well."]),
    (["What is your name?", "Who are you?", "What are you?", "What's your name?"],
     ["I am a tiny demo model for k3. I know a few simple facts and I can remember what you tell me."]),
    (["What can you do?", "How can you help me?", "What do you know?"],
     ["I can answer simple questions about capitals, colours, opposites, days, months and small "
      "sums, and I can remember your name, your favourite number and your favourite colour."]),
    (["Are you a robot?", "Are you human?", "Are you an AI?"],
     ["I am a small language model, not a human."]),
    (["Nice to meet you.", "Nice to meet you!", "Pleased to meet you."],
     ["Nice to meet you too!"]),
    (["I am happy today.", "I feel great!", "I am so happy!"],
     ["That is wonderful to hear!"]),
    (["I am sad.", "I feel sad today.", "I am tired."],
     ["I am sorry to hear that. I hope you feel better soon."]),
    (["Do you like music?", "Do you like books?", "Do you like cats?", "Do you like dogs?"],
     ["I am only a small model, but I think that sounds nice!"]),
    (["What is the weather like?", "Is it going to rain?"],
     ["I cannot see the weather, but I hope it is nice where you are."]),
    (["Tell me a joke.", "Do you know a joke?"],
     ["Why did the cat sit on the computer? To keep an eye on the mouse!",
      "What do you call a sleeping bull? A bulldozer!",
      "Why did the banana go to the doctor? It was not peeling well!"]),
    (["Can you help me?", "I have a question."], ["Of course! What would you like to know?"]),
    (["That is right.", "Correct!", "Well done!", "Great!", "Cool!", "OK.", "Okay."],
     ["Thank you!", "Great! Do you have another question?"]),
]

UNKNOWN_Q = [
    "What is the meaning of life?", "Who will win the next game?", "What is the capital of Mars?",
    "How tall is the tallest tree?", "What is my mother's name?", "What time is it?",
    "What did I eat for breakfast?", "How many stars are in the sky?", "What is the price of gold?",
    "Who wrote the first book?", "What is the speed of light?", "What will happen tomorrow?",
]
UNKNOWN_A = ["I'm sorry, I don't know that.", "I'm sorry, I don't know the answer to that."]

SYSTEM_MSGS = ["You are a helpful assistant.", "You are a friendly assistant.",
               "Answer briefly.", "You are a helpful and friendly assistant. Keep answers short."]


# ---------------------------------------------------------------------------------------------
# Fact turns
# ---------------------------------------------------------------------------------------------

def _pick_template(rng, kind, entity, table):
    while True:
        i = rng.randrange(len(table))
        if (kind, i, entity) not in HELDOUT_COMBOS:
            return i


def add_pair(rng):
    while True:
        da, db = rng.choice([(1, 1), (1, 2), (2, 1), (2, 2), (2, 2), (2, 2)])
        a = rng.randrange(0, 10) if da == 1 else rng.randrange(10, 100)
        b = rng.randrange(0, 10) if db == 1 else rng.randrange(10, 100)
        if (a, b) not in HELDOUT_ADD_SET:
            return a, b


def sub_pair(rng):
    while True:
        da, db = rng.choice([(1, 1), (2, 1), (2, 2), (2, 2), (2, 2)])
        a = rng.randrange(0, 10) if da == 1 else rng.randrange(10, 100)
        b = rng.randrange(0, 10) if db == 1 else rng.randrange(10, 100)
        if a >= b and (a, b) not in HELDOUT_SUB_SET:
            return a, b


def fact_turn(rng):
    """Returns (question, answer, reasoning)."""
    k = rng.random()
    if k < 0.27:
        c, cap = rng.choice(CAPITALS)
        q = CAPITAL_Q[_pick_template(rng, "capital", c, CAPITAL_Q)].format(c=c)
        a = capital_answer(c, cap)
        return q, a, f"The user asks for the capital of {c}. The capital of {c} is {cap}."
    if k < 0.39:
        x, col = rng.choice(COLOURS_OF)
        q = COLOUR_Q[_pick_template(rng, "colour", x, COLOUR_Q)].format(x=x)
        return q, colour_answer(x, col), f"The user asks about the colour of {x}. It is {col}."
    if k < 0.49:
        w = rng.choice(sorted(OPPOSITES))
        q = OPPOSITE_Q[_pick_template(rng, "opposite", w, OPPOSITE_Q)].format(w=w)
        return q, opposite_answer(w), f"The opposite of {w} is {OPPOSITES[w]}."
    if k < 0.56:
        d = rng.choice(DAYS)
        nxt = rng.random() < 0.5
        kind = "day_next" if nxt else "day_prev"
        tab = DAY_NEXT_Q if nxt else DAY_PREV_Q
        q = tab[_pick_template(rng, kind, d, tab)].format(d=d)
        a, ans = day_answer(d, nxt)
        return q, a, f"The days go Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. So it is {ans}."
    if k < 0.63:
        m = rng.choice(MONTHS)
        nxt = rng.random() < 0.5
        kind = "month_next" if nxt else "month_prev"
        tab = MONTH_NEXT_Q if nxt else MONTH_PREV_Q
        q = tab[_pick_template(rng, kind, m, tab)].format(m=m)
        a, ans = month_answer(m, nxt)
        return q, a, f"The month {'after' if nxt else 'before'} {m} is {ans}."
    if k < 0.83:
        a_, b_ = add_pair(rng)
        q = rng.choice(ADD_Q).format(a=a_, b=b_)
        return q, f"{a_} plus {b_} is {a_ + b_}.", f"I need to add {a_} and {b_}. {a_} + {b_} = {a_ + b_}."
    a_, b_ = sub_pair(rng)
    q = rng.choice(SUB_Q).format(a=a_, b=b_)
    return q, f"{a_} minus {b_} is {a_ - b_}.", f"I need to subtract {b_} from {a_}. {a_} - {b_} = {a_ - b_}."


def small_talk_turn(rng):
    if rng.random() < 0.12:
        return rng.choice(UNKNOWN_Q), rng.choice(UNKNOWN_A), "I do not know the answer to this question."
    if rng.random() < 0.08:
        return (rng.choice(["Tell me a story.", "Can you tell me a short story?", "Tell me a short story, please."]),
                story(rng), "The user wants a short story. I will tell a simple one.")
    us, as_ = rng.choice(SMALL_TALK)
    return rng.choice(us), rng.choice(as_), "The user is making small talk. I should reply kindly."


# --- memory (recall) turns ----------------------------------------------------------------------

def state_turn(rng, slot, value):
    if slot == "name":
        q = rng.choice(["My name is {v}.", "Hi, I am {v}.", "Hello, my name is {v}.", "Call me {v}.",
                        "I'm {v}.", "Hi! My name is {v}.", "You can call me {v}.",
                        "Hello! I am {v}."]).format(v=value)
        a = rng.choice(["Nice to meet you, {v}!", "Hello, {v}! Nice to meet you.",
                        "Hi {v}! How can I help you today?"]).format(v=value)
        r = f"The user says their name is {value}. I will remember it."
    elif slot == "number":
        q = rng.choice(["My favourite number is {v}.", "My favorite number is {v}.",
                        "I like the number {v}.", "Remember this number: {v}.",
                        "My lucky number is {v}."]).format(v=value)
        a = rng.choice(["Got it! Your favourite number is {v}.", "I will remember the number {v}.",
                        "{v} is a great number!"]).format(v=value)
        r = f"The user's favourite number is {value}. I will remember it."
    else:
        q = rng.choice(["My favourite colour is {v}.", "My favorite color is {v}.",
                        "I love the colour {v}.", "I like {v} the most."]).format(v=value)
        a = rng.choice(["{V} is a lovely colour!", "Got it, your favourite colour is {v}.",
                        "I like {v} too!"]).format(v=value, V=value.capitalize())
        r = f"The user's favourite colour is {value}. I will remember it."
    return q, a, r


def recall_turn(rng, slot, value):
    if slot == "name":
        q = rng.choice(["What is my name?", "What's my name?", "Do you remember my name?",
                        "Who am I?", "Can you tell me my name?", "What did I say my name was?",
                        "Do you know my name?"])
        a = rng.choice(["Your name is {v}.", "You told me your name is {v}.",
                        "Yes, your name is {v}."]).format(v=value)
        r = f"The user told me earlier that their name is {value}."
    elif slot == "number":
        q = rng.choice(["What is my favourite number?", "What's my favorite number?",
                        "Do you remember my number?", "Which number did I tell you?",
                        "What number did I say?", "What is my lucky number?"])
        a = rng.choice(["Your favourite number is {v}.", "You told me the number {v}.",
                        "The number you told me is {v}."]).format(v=value)
        r = f"The user told me earlier that their number is {value}."
    else:
        q = rng.choice(["What is my favourite colour?", "What's my favorite color?",
                        "Do you remember my favourite colour?", "Which colour do I like?"])
        a = rng.choice(["Your favourite colour is {v}.", "You told me you like {v}.",
                        "You said your favourite colour is {v}."]).format(v=value)
        r = f"The user told me earlier that their favourite colour is {value}."
    return q, a, r


def unknown_recall_turn(rng, slot):
    q, _, _ = recall_turn(rng, slot, "x")
    a = {"name": "You have not told me your name yet.",
         "number": "You have not told me a number yet.",
         "colour": "You have not told me your favourite colour yet."}[slot]
    return q, a, "The user has not told me this yet."


def conversation(rng, msgs, turns, thinking):
    """A chat record: `msgs` (e.g. a system message) then each (question, answer, reasoning)
    turn, with a drawn thinking effort."""
    for q, a, r in turns:
        msgs.append({"role": "user", "content": q})
        m = {"role": "assistant", "content": a}
        if thinking:
            m["reasoning"] = r
        msgs.append(m)
    return {"kind": "chat", "thinking": thinking,
            "effort": rng.choice(["max", "max", "max", "low", "high"]), "messages": msgs}


def gen_chat(rng, thinking):
    msgs = []
    if rng.random() < 0.08:
        msgs.append({"role": "system", "content": rng.choice(SYSTEM_MSGS)})
    mem = {}           # slot -> (value, turn index)
    n_turns = rng.choice([2, 3, 3, 4, 4, 5, 5, 6, 7, 8]) if not thinking else rng.choice([1, 2, 2, 3, 3, 4, 5])
    turns = []
    if rng.random() < 0.35:
        us, as_ = SMALL_TALK[rng.randrange(0, 4)]
        turns.append((rng.choice(us), rng.choice(as_), "The user greets me. I should greet them back."))
    while len(turns) < n_turns:
        t = len(turns)
        ready = [s for s, (_, ti) in mem.items() if t - ti >= 1]
        unset = [s for s in ("name", "number", "colour") if s not in mem]
        opts = [("fact", 0.36), ("talk", 0.10)]
        if unset:
            opts += [("state", 0.30), ("unknown", 0.02)]
        if ready:
            opts += [("recall", 0.40)]
        k = rng.random() * sum(w for _, w in opts)
        for kind, w in opts:
            if k < w:
                break
            k -= w
        if kind == "state":
            slot = rng.choice(unset)
            v = any_name(rng) if slot == "name" else fav_number(rng) if slot == "number" else rng.choice(FAV_COLOURS)
            mem[slot] = (v, t)
            turns.append(state_turn(rng, slot, v))
        elif kind == "recall":
            slot = rng.choice(ready)
            turns.append(recall_turn(rng, slot, mem[slot][0]))
        elif kind == "unknown":
            turns.append(unknown_recall_turn(rng, rng.choice(unset)))
        elif kind == "talk":
            turns.append(small_talk_turn(rng))
        else:
            turns.append(fact_turn(rng))
    return conversation(rng, msgs, turns, thinking)


def gen_name_chat(rng, thinking):
    """A conversation built around a name: stated in the first turns, asked back later, with
    other turns in between (the copying the recall test needs, on names never seen before)."""
    name = any_name(rng)
    turns = []
    if rng.random() < 0.3:
        us, as_ = SMALL_TALK[rng.randrange(0, 4)]
        turns.append((rng.choice(us), rng.choice(as_), "The user greets me. I should greet them back."))
    turns.append(state_turn(rng, "name", name))
    for _ in range(rng.choice([0, 1, 1, 2, 2, 3])):
        turns.append(fact_turn(rng) if rng.random() < 0.75 else small_talk_turn(rng))
    turns.append(recall_turn(rng, "name", name))
    if rng.random() < 0.3:
        turns.append(fact_turn(rng))
        turns.append(recall_turn(rng, "name", name))
    return conversation(rng, [], turns, thinking)


def fact_statement(rng):
    f = rng.random()
    if f < 0.22:
        c, cap = rng.choice(CAPITALS)
        return capital_answer(c, cap)
    if f < 0.32:
        x, col = rng.choice(COLOURS_OF)
        return colour_answer(x, col)
    if f < 0.40:
        return opposite_answer(rng.choice(sorted(OPPOSITES)))
    if f < 0.44:
        return day_answer(rng.choice(DAYS), rng.random() < 0.5)[0]
    if f < 0.48:
        return month_answer(rng.choice(MONTHS), rng.random() < 0.5)[0]
    if f < 0.76:
        a, b = add_pair(rng)
        return f"{a} plus {b} is {a + b}."
    a, b = sub_pair(rng)
    return f"{a} minus {b} is {a - b}."


def memory_drill(rng):
    """Plain-text copying practice: values stated, other sentences, then asked back."""
    slots = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["name", "name", "number", "colour"])
        v = any_name(rng) if kind == "name" else fav_number(rng) if kind == "number" else rng.choice(FAV_COLOURS)
        who = any_name(rng)
        slots.append((kind, v, who))
    out = []
    for kind, v, who in slots:
        out.append({"name": f"{who}'s friend is called {v}.", "number": f"{who}'s number is {v}.",
                    "colour": f"{who}'s favourite colour is {v}."}[kind])
    for _ in range(rng.randint(0, 3)):
        out.append(fact_statement(rng) if rng.random() < 0.5 else simple_sentence(rng))
    rng.shuffle(slots)
    for kind, v, who in slots:
        out.append({"name": f"The name of {who}'s friend is {v}.", "number": f"The number of {who} is {v}.",
                    "colour": f"The favourite colour of {who} is {v}."}[kind])
    return " ".join(out)


def copy_drill(rng):
    """Raw text that can only be continued by copying: a list of made-up names, then the same
    list again (the second half is predictable only from the first)."""
    names = [any_name(rng) for _ in range(rng.randint(4, 10))]
    sep = rng.choice([" Again: ", ". Once more: ", " and again ", ". Repeat: "])
    first = " ".join(names)
    return first + sep + first + "."


def gen_raw(rng, copy_share=0.0):
    if copy_share and rng.random() < copy_share:
        return {"kind": "raw", "text": copy_drill(rng)}
    k = rng.random()
    if k < 0.3:
        parts = [story(rng)]
        if rng.random() < 0.5:
            parts.append(story(rng))
        return {"kind": "raw", "text": "\n\n".join(parts)}
    if k < 0.45:
        return {"kind": "raw", "text": " ".join(simple_sentence(rng) for _ in range(rng.randint(3, 8)))}
    if k < 0.6:
        return {"kind": "raw", "text": memory_drill(rng)}
    # facts and sums stated as plain text
    return {"kind": "raw", "text": " ".join(fact_statement(rng) for _ in range(rng.randint(8, 20)))}


MIX = {"chat_nothink": 0.47, "chat_think": 0.20, "raw": 0.33}


def generate(seed, n, name_focus=0.0, copy_share=0.0, blend_share=0.0, people_share=0.0):
    """n records from `seed`; a share `name_focus` of them are name dialogues, a share
    `copy_share` of the raw records are copy drills, a share `blend_share` of all made-up
    names are spliced from pieces of real words (`blend_name`), and a share `people_share` of
    story heroes and sentence subjects are people (`PEOPLE`)."""
    global BLEND_SHARE, PEOPLE_SHARE
    BLEND_SHARE, PEOPLE_SHARE = blend_share, people_share
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        k = rng.random()
        if name_focus and rng.random() < name_focus:
            r = gen_name_chat(rng, rng.random() < 0.25)
        elif k < MIX["chat_nothink"]:
            r = gen_chat(rng, False)
        elif k < MIX["chat_nothink"] + MIX["chat_think"]:
            r = gen_chat(rng, True)
        else:
            r = gen_raw(rng, copy_share)
        if _contains_raw_prompt(r):
            continue          # the grammar can produce a held-out raw prompt: drop the record
        out.append(r)
    return out


def _record_texts(r):
    if r["kind"] == "raw":
        return [r["text"]]
    return [m["content"] for m in r["messages"]] + [m.get("reasoning") or "" for m in r["messages"]]


def _contains_raw_prompt(r):
    return any(p in t for t in _record_texts(r) for p in HELDOUT_RAW_PROMPTS)


# ---------------------------------------------------------------------------------------------
# held-out enforcement
# ---------------------------------------------------------------------------------------------

def _heldout_questions():
    qs = []
    for kind, i, ent in sorted(HELDOUT_COMBOS):
        tab = HELDOUT_TEMPLATES[kind]
        key = {"capital": "c", "colour": "x", "opposite": "w", "day_next": "d", "day_prev": "d",
               "month_next": "m", "month_prev": "m"}[kind]
        qs.append(tab[i].format(**{key: ent}))
    return qs


_HQ = set(_heldout_questions())
_ARITH = re.compile(r"(\d+) (plus|\+|minus|-|take away) (\d+)|add (\d+) and (\d+)|sum of (\d+) and (\d+)"
                    r"|subtract (\d+) from (\d+)", re.I)
_NAME_RE = re.compile(r"\b(" + "|".join(HELDOUT_NAMES) + r")\b")


def check_record(r):
    """Raise if a record contains held-out material."""
    texts = []
    if r["kind"] == "raw":
        texts.append(r["text"])
    else:
        for m in r["messages"]:
            texts.append(m["content"])
            if m.get("reasoning"):
                texts.append(m["reasoning"])
            if m["role"] == "user" and m["content"] in _HQ:
                raise AssertionError(f"held-out question in training: {m['content']!r}")
    for t in texts:
        for mt in _ARITH.finditer(t):
            g = mt.groups()
            if g[0] is not None:
                a, op, b = int(g[0]), g[1], int(g[2])
                if op in ("plus", "+") and (a, b) in HELDOUT_ADD_SET:
                    raise AssertionError(f"held-out sum in training: {t!r}")
                if op not in ("plus", "+") and (a, b) in HELDOUT_SUB_SET:
                    raise AssertionError(f"held-out difference in training: {t!r}")
            elif g[3] is not None and (int(g[3]), int(g[4])) in HELDOUT_ADD_SET:
                raise AssertionError(t)
            elif g[5] is not None and (int(g[5]), int(g[6])) in HELDOUT_ADD_SET:
                raise AssertionError(t)
            elif g[7] is not None and (int(g[8]), int(g[7])) in HELDOUT_SUB_SET:
                raise AssertionError(t)
        if _NAME_RE.search(t):
            raise AssertionError(f"held-out name in training: {t!r}")
        for p in HELDOUT_RAW_PROMPTS:
            if p in t:
                raise AssertionError(f"held-out raw prompt in training: {t!r}")
    if r["kind"] == "chat":
        for m in r["messages"]:
            if m["role"] == "user":
                for num in HELDOUT_NUMBERS:
                    if re.search(r"(number|Remember this number)\D*\b" + num + r"\b", m["content"]):
                        raise AssertionError(f"held-out recall number in training: {m['content']!r}")


# ---------------------------------------------------------------------------------------------
# held-out test set
# ---------------------------------------------------------------------------------------------

def heldout_set():
    facts = []
    # 20 arithmetic questions on held-out pairs, all with templates seen in training
    for i, (a, b) in enumerate(HELDOUT_ADD[:10]):
        facts.append({"kind": "add", "question": ADD_Q[i % 3].format(a=a, b=b), "expect": str(a + b),
                      "mention": [str(a), str(b)]})
    for i, (a, b) in enumerate(HELDOUT_SUB[:10]):
        facts.append({"kind": "sub", "question": SUB_Q[i % 3].format(a=a, b=b), "expect": str(a - b),
                      "mention": [str(a), str(b)]})
    caps = dict(CAPITALS)
    cols = dict(COLOURS_OF)
    for kind, i, ent in sorted(HELDOUT_COMBOS):
        tab = HELDOUT_TEMPLATES[kind]
        if kind == "capital":
            q, exp = tab[i].format(c=ent), caps[ent]
        elif kind == "colour":
            q, exp = tab[i].format(x=ent), cols[ent]
        elif kind == "opposite":
            q, exp = tab[i].format(w=ent), OPPOSITES[ent]
        elif kind.startswith("day"):
            q, exp = tab[i].format(d=ent), day_answer(ent, kind == "day_next")[1]
        else:
            q, exp = tab[i].format(m=ent), month_answer(ent, kind == "month_next")[1]
        facts.append({"kind": kind, "question": q, "expect": exp, "mention": [ent.split()[-1]],
                      "template_index": i})
    assert len(facts) == 50, len(facts)
    fillers = ["What is the capital of Spain?", "How are you?", "What colour is snow?",
               "What is 4 plus 3?", "Tell me a joke.", "What is the opposite of big?",
               "What month comes after May?", "Thank you!", "What is 20 minus 5?",
               "What day comes before Sunday?"]
    stmts = [("name", "My name is {v}."), ("number", "My favourite number is {v}."),
             ("name", "Hi, I am {v}."), ("number", "Remember this number: {v}."),
             ("name", "Call me {v}."), ("name", "Hello, my name is {v}."),
             ("number", "My lucky number is {v}."), ("name", "You can call me {v}."),
             ("number", "My favorite number is {v}."), ("name", "I'm {v}.")]
    asks = {"name": ["What is my name?", "Do you remember my name?", "What's my name?"],
            "number": ["What is my favourite number?", "Which number did I tell you?",
                       "What's my favorite number?"]}
    recall = []
    ni, nn = 0, 0
    for i, (slot, tpl) in enumerate(stmts):
        if slot == "name":
            v = HELDOUT_NAMES[ni % len(HELDOUT_NAMES)]
            ni += 1
        else:
            v = HELDOUT_NUMBERS[nn % len(HELDOUT_NUMBERS)]
            nn += 1
        recall.append({"slot": slot, "value": v,
                       "turns": [tpl.format(v=v), fillers[i], asks[slot][i % 3]],
                       "expect_turn": 3, "expect": v})
    return {
        "format": "k3-demo-heldout/1",
        "scoring": ("Normalise a text by lowercasing it, replacing every character that is not a "
                    "letter, digit or space by a space and collapsing runs of spaces. A reply is "
                    "correct when its normalised text ends with the normalised `expect` (at a word "
                    "boundary) and contains every word of `mention` (if any) as a whole word. "
                    "Facts are asked as the only user turn of a fresh conversation; recall "
                    "conversations are three user turns, scored on the third reply."),
        "render": {"thinking": False, "greedy": True},
        "facts": facts,
        "recall": recall,
        "raw_prompts": HELDOUT_RAW_PROMPTS,
    }


def normalise(s):
    s = re.sub(r"[^a-z0-9 ]", " ", s.lower())
    return " ".join(s.split())


def score_reply(reply, expect, mention=()):
    r, e = normalise(reply), normalise(expect)
    if not (r == e or r.endswith(" " + e)):
        return False
    words = r.split()
    return all(normalise(w) in words for w in mention)


def corpus_words(paths):
    """Every word that occurs starting in lowercase in the records of these corpus.jsonl files
    (the raw-mode vocabulary check, tests/fixtures/demo/words.txt)."""
    out = set()
    for path in paths:
        with open(path) as f:
            for line in f:
                for t in _record_texts(json.loads(line)):
                    out.update(w for w in re.findall(r"[A-Za-z]+", t) if w[0].islower())
    return sorted(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--words", metavar="OUT", help="write the lowercase words of --corpus files to OUT")
    ap.add_argument("--corpus", nargs="*", default=[], help="corpus.jsonl files for --words")
    ap.add_argument("--out")
    ap.add_argument("--n", type=int, default=200000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--heldout")
    ap.add_argument("--show", type=int, default=0)
    a = ap.parse_args()
    if a.words:
        with open(a.words, "w") as f:
            f.write("".join(w + "\n" for w in corpus_words(a.corpus)))
    if a.heldout:
        with open(a.heldout, "w") as f:
            json.dump(heldout_set(), f, indent=1)
            f.write("\n")
    if a.out or a.show:
        recs = generate(a.seed, a.n)
        for r in recs:
            check_record(r)
        if a.out:
            with open(a.out, "w") as f:
                for r in recs:
                    f.write(json.dumps(r) + "\n")
        for r in recs[:a.show]:
            print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

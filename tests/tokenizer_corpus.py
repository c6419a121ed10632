"""A deterministic corpus of strings that exercises every branch of a byte-level BPE pre-tokenizer.

Hand-written edge cases come first, then strings assembled at random (seeded) from fragments of prose,
code, numbers, emoji, many scripts, whitespace runs, contractions, punctuation and chat markers, then
"character soup" strings drawn from a pool of code points of every class the pre-tokenizer tells apart.
"""

from __future__ import annotations

import random

EDGE_CASES: list[str] = [
    "",
    " ",
    "a",
    "1",
    "\n",
    "\t",
    "'",
    "é",
    "😀",
    "中",
    "  ",
    "   ",
    "\n\n",
    "\r\n",
    " \n ",
    "a ",
    " a",
    "a  b",
    "a   b",
    "a\tb",
    "a\t\tb",
    "a \tb",
    "a\t b",
    "a\n\nb",
    "a\r\n\r\nb",
    "trailing spaces   ",
    "   leading spaces",
    "\t\tleading tabs",
    "line one\nline two\n",
    "it's",
    "IT'S",
    "It'S",
    "we're here",
    "WE'RE",
    "you've",
    "I'm",
    "I'M",
    "they'll",
    "THEY'LL",
    "she'd",
    "don't",
    "DON'T",
    "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "''s",
    "?'s",
    " 's",
    "rock'n'roll",
    "'twas",
    "x'",
    "12345",
    " 12345",
    "a1b2c3",
    "3.14159",
    "1,000,000",
    "0x1F",
    "2024-01-15T10:30:00Z",
    "v1.2.3",
    "½ ¾ ² ³ Ⅻ ⅷ",
    "٣٤٥ ۱۲۳ १२३ ๑๒๓",
    "!!!",
    "...",
    "?!?!",
    " !",
    " ...",
    "—–-",
    "«quoted» “curly” „low“",
    "#$%&*@^~`|\\",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>user\nHello!<|im_end|>\n",
    "<|im_start|><|im_end|>",
    "<<|im_start|>>",
    "<|im_start",
    "<|im_start|",
    "im_start|>",
    "<|im_start|><|im_start|>",
    "text<|im_end|>text",
    " <|im_start|> ",
    "<repo_name>x<reponame>y<file_sep><filename>z",
    "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<tool_call>{\"name\": \"f\"}</tool_call>",
    "<|endoftext|><|endoftext|",
    "café naïve résumé",
    "cafe\u0301 nai\u0308ve",
    "e\u0301\u0301\u0301",
    "\u0301",
    "Å Å Å",
    "Tiếng Việt có dấu",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "你好，世界。",
    "こんにちは、世界！カタカナ",
    "안녕하세요 세계",
    "مرحبا بالعالم",
    "שלום עולם",
    "Привет, мир!",
    "Γειά σου Κόσμε",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "❤️",
    "🇫🇷🇯🇵",
    "1️⃣",
    "\u200d",
    "\u200b",
    "\ufeff",
    "\u00a0",
    "a\u00a0b",
    "a\u00a0\u00a0b",
    "\u3000",
    "全角\u3000スペース",
    "\u2028",
    "\u2029",
    "\u0085",
    "\u1680",
    "\u2009thin\u202fnarrow\u205fmath",
    "\x0b\x0c",
    "a\x0bb",
    "\x1c\x1d\x1e\x1f",
    "a\x1cb",
    "\x00",
    "a\x00b",
    "\x01\x7f",
    "\u01c5\u02b0\u1c89\u1c8a",
    "\U00010d40\U00010d49",
    "\U0001f600\U0001f601\U0001f602",
    "\U00020000\U0002a6d6",
    "\uffff\ufffd",
    "\U0010ffff",
    "a" * 300,
    "9" * 120,
    " " * 80,
    "\n" * 40,
    "ab " * 100,
    "x = [1, 2, 3]\nprint(x)\n",
    'def f(a, b):\n    """Doc."""\n    return a + b  # sum\n',
    "int main(void) {\n\treturn 0;\n}\n",
    '{\n  "key": "value",\n  "n": 42,\n  "list": [true, false, null]\n}',
    "\tif (x) {\n\t\ty++;\n\t}\n",
    "https://example.com/path?q=1&x=2#frag",
    "user@example.com",
    "C:\\Program Files\\app.exe",
    "$ ls -la | grep '.py'",
]

_PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged that we're all a bit tired.",
    "They'll say she'd have done it if I'm right; you've seen it.",
    "HELLO WORLD, THIS IS LOUD.",
    "Mr. Smith's car isn't here; it's at Jane's.",
    "A sentence with    multiple   spaces.",
    "Numbers like 42, 3.5 and 1e-9 appear in text.",
    "Don't stop believing!",
    "O'Reilly and D'Angelo met at the café.",
    "Well... that's (mostly) fine—I think.",
]

_CODE = [
    "for i in range(10):\n    print(i ** 2)\n",
    "class Foo:\n    def __init__(self):\n        self.x = {'a': 1}\n",
    "#include <stdio.h>\nint main() {\n\tprintf(\"%d\\n\", 42);\n}\n",
    "if (a && b || !c) { x += y >> 2; }",
    '{"name": "test", "values": [1, 2.5, -3e10], "nested": {"ok": true}}',
    "  return [x for x in xs if x % 2 == 0]\n",
    "SELECT * FROM users WHERE id = 7;",
    "<div class=\"main\"><p>Hi</p></div>",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }",
    "\t\t// indented comment\n\t\tfoo();\r\n",
    "x=1;y=2;z=x+y",
    "arr[i][j] = (a - b) * c / d;",
]

_NUMBERS = [
    "0", "7", "42", "1234567890", "007", "3.14", "-12", "+1 (555) 010-9999", "1e10", "0b1010",
    "100%", "$99.99", "€5,00", "12:30", "2023", "1st 2nd 3rd", "10x", "x10", "٣", "½", "Ⅷ", "²",
]

_EMOJI = [
    "😀", "😂", "🙏🏿", "👋🏻", "👨‍💻", "👩‍❤️‍👨", "🧑🏽‍🚀", "🏳️‍⚧️", "🇺🇸", "🇩🇪", "✨", "🔥🔥🔥", "☕", "⚡️",
    "#️⃣", "🫠", "🪿",
]

_SCRIPTS = [
    "日本語のテキストです。", "漢字とひらがな", "中文文本测试", "繁體中文", "한국어 문장입니다", "한글",
    "العربية الفصحى", "فارسی", "עברית", "Русский текст", "Українська", "Ελληνικά", "ქართული", "Հայերեն",
    "हिन्दी", "বাংলা", "தமிழ்", "ไทย", "ລາວ", "ខ្មែរ", "አማርኛ", "Ñandú", "Straße", "Øresund", "İstanbul",
    "ǅungla", "ﬁancé", "Ｆｕｌｌｗｉｄｔｈ", "ｶﾀｶﾅ",
]

_WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n", "\n ", " \t ", "\u00a0", "\u3000",
               "    ", "\n\t", "\r", "\u2003", "\x0b"]

_PUNCT = ["!", "?", ".", ",", ";", ":", "...", "!!", "?!", "-", "--", "—", "(", ")", "[", "]", "{", "}", "\"",
          "'", "`", "/", "\\", "*", "&", "%", "#", "@", "~", "^", "|", "<", ">", "=", "+", "_", "«", "»", "¿",
          "¡", "§", "©", "®", "™", "°", "•", "…"]

_CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL", "'D",
                 "n't", "'", "''", "s'"]

_MARKERS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\n", "<|im_start|>assistant\n",
            "<|im_end|>\n", "<|im_", "|>", "<|", "<tool_call>", "<tool_call"]

_FRAGMENT_POOLS = [_PROSE, _CODE, _NUMBERS, _EMOJI, _SCRIPTS, _WHITESPACE, _PUNCT, _CONTRACTIONS, _MARKERS]

_JOINERS = ["", "", " ", " ", "\n", "\t", "  ", "\r\n", "'", "-"]

# Code points of every class the pre-tokenizer distinguishes (letters, numbers, spaces, other), with
# combining marks, joiners, astral characters and controls among them.
_SOUP = (
    list("aAzZ09 '\t\n\r.,!?-_<>|/\\\"")
    + list("éÅßñçøıİ")
    + ["\u0301", "\u0308", "\u200d", "\u200b", "\ufe0f", "\u00a0", "\u3000", "\u2028", "\x0b", "\x1c", "\x00"]
    + list("中日한ا٣½Ⅻ²ह्")
    + ["😀", "🏽", "👍", "\U00020000", "\U00010d40"]
)


def _fragment_string(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 6)):
        pool = rng.choice(_FRAGMENT_POOLS)
        parts.append(rng.choice(pool))
        parts.append(rng.choice(_JOINERS))
    text = "".join(parts)
    if rng.random() < 0.2:
        text = rng.choice(_WHITESPACE) + text
    if rng.random() < 0.2:
        text += rng.choice(_WHITESPACE)
    return text


def _soup_string(rng: random.Random) -> str:
    return "".join(rng.choice(_SOUP) for _ in range(rng.randint(1, 24)))


def corpus(n: int = 2500, seed: int = 0) -> list[str]:
    """Return n strings: the edge cases, then seeded random fragment mixes and character soups."""
    rng = random.Random(seed)
    strings = list(EDGE_CASES[:n])
    while len(strings) < n:
        strings.append(_soup_string(rng) if rng.random() < 0.3 else _fragment_string(rng))
    return strings

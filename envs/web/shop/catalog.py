"""The shop's generated catalog and its shopping goals, and WebShop's reward.

Products have a type (t-shirt, kettle, ...) in a category, attributes (cotton, dishwasher safe, ...),
options (color and size, or color alone, ...) and a price; titles are unique. A goal picks one product,
some of its attributes, one value of each of its options, and a price limit above its price, and says it in
words: "I need a cotton t-shirt, slim fit, in red, size M, for under $24.00". Other products can satisfy
the goal as well: the reward looks at what was bought, not at which product.

WebShop's reward (Yao et al., 2022), on the product bought with the options chosen:

    reward = r_type * (attributes matched + options matched + [price <= limit]) / (attributes + options + 1)

r_type is 1 for the goal's product type, 0.5 for another type of its category and 0.1 otherwise.
Everything is a function of the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

COLORS = ("black", "white", "red", "blue", "green", "grey", "navy", "pink", "yellow", "beige")
SIZES = ("XS", "S", "M", "L", "XL")
TYPES: dict[str, dict] = {  # type -> category, attributes it can have, its option dimensions
    "t-shirt": {"category": "clothing", "options": {"color": COLORS, "size": SIZES},
                "attributes": ("cotton", "organic", "slim fit", "long sleeve", "machine wash", "v-neck")},
    "hoodie": {"category": "clothing", "options": {"color": COLORS, "size": SIZES},
               "attributes": ("fleece", "zip", "cotton", "oversized", "machine wash", "pockets")},
    "jeans": {"category": "clothing", "options": {"color": ("blue", "black", "grey"), "size": SIZES},
              "attributes": ("stretch", "slim fit", "high waist", "organic", "bootcut", "distressed")},
    "socks": {"category": "clothing", "options": {"color": COLORS, "size": ("S", "M", "L")},
              "attributes": ("wool", "cotton", "ankle", "cushioned", "pack of 6", "moisture wicking")},
    "mug": {"category": "kitchen", "options": {"color": COLORS},
            "attributes": ("ceramic", "dishwasher safe", "microwave safe", "large", "insulated", "handmade")},
    "kettle": {"category": "kitchen", "options": {"color": ("black", "white", "grey", "red")},
               "attributes": ("electric", "stainless steel", "glass", "cordless", "auto shut-off", "1.7 liter")},
    "frying pan": {"category": "kitchen", "options": {"size": ("8 inch", "10 inch", "12 inch")},
                   "attributes": ("non-stick", "cast iron", "induction", "oven safe", "stainless steel", "lid")},
    "headphones": {"category": "electronics", "options": {"color": ("black", "white", "blue", "pink")},
                   "attributes": ("wireless", "noise cancelling", "over-ear", "bluetooth", "foldable", "microphone")},
    "charger": {"category": "electronics", "options": {"color": ("black", "white")},
                "attributes": ("usb-c", "fast charging", "wireless", "two ports", "compact", "65 watt")},
    "keyboard": {"category": "electronics", "options": {"color": ("black", "white", "grey")},
                 "attributes": ("mechanical", "wireless", "backlit", "compact", "quiet", "ergonomic")},
    "shampoo": {"category": "beauty", "options": {"size": ("8 oz", "16 oz", "32 oz")},
                "attributes": ("sulfate free", "organic", "for dry hair", "fragrance free", "vegan", "argan oil")},
    "lotion": {"category": "beauty", "options": {"size": ("8 oz", "16 oz")},
               "attributes": ("unscented", "for sensitive skin", "shea butter", "vegan", "spf 30", "organic")},
}
BRANDS = ("Northwind", "Acme", "Bluebird", "Fjord", "Kestrel", "Lumen", "Maple & Co", "Orbit", "Pioneer", "Quill",
          "Redwood", "Summit", "Tandem", "Umber", "Vantage", "Willow")


@dataclass(frozen=True)
class Product:
    id: str
    title: str
    type: str
    attributes: tuple[str, ...]
    options: dict[str, tuple[str, ...]] = field(hash=False)
    price: float

    @property
    def category(self) -> str:
        """The category of the product's type (clothing, kitchen, ...)."""
        return TYPES[self.type]["category"]

    def text(self) -> str:
        """What the shop's search engine indexes."""
        return f"{self.title}\n{self.type}. {', '.join(self.attributes)}. {self.category}"


@dataclass(frozen=True)
class Goal:
    product_id: str  # the product the goal was drawn from (one of possibly several that satisfy it)
    type: str
    attributes: tuple[str, ...]
    options: dict[str, str] = field(hash=False)
    price_limit: float

    @property
    def instruction(self) -> str:
        """The goal in words: "I need a cotton t-shirt, slim fit, in red, size M, for under $24.00"."""
        parts = [f"I need a {' '.join(self.attributes[:1])} {self.type}".replace("  ", " ")]
        if len(self.attributes) > 1:
            parts.append(", ".join(self.attributes[1:]))
        for name, value in self.options.items():
            parts.append(f"in {value}" if name == "color" else f"size {value}")
        return ", ".join(parts) + f", for under ${self.price_limit:.2f}"

    def search_query(self) -> str:
        """The goal's attributes and type, as the scripted solver searches for them."""
        return " ".join((*self.attributes, self.type))

    def to_dict(self) -> dict:
        """The goal as JSON-ready data (a task's `goal`); `from_dict` reads it back."""
        return {"product_id": self.product_id, "type": self.type, "attributes": list(self.attributes),
                "options": dict(self.options), "price_limit": self.price_limit}

    @classmethod
    def from_dict(cls, d: dict) -> "Goal":
        """The goal that `to_dict` wrote."""
        return cls(d["product_id"], d["type"], tuple(d["attributes"]), dict(d["options"]), d["price_limit"])


def generate_catalog(seed: int = 0, n_products: int = 400) -> list[Product]:
    """`n_products` products with unique titles, drawn from `TYPES` and `BRANDS` by `seed`."""
    rng = random.Random(seed)
    products, titles = [], set()
    while len(products) < n_products:
        type_name = rng.choice(sorted(TYPES))
        spec = TYPES[type_name]
        attributes = tuple(sorted(rng.sample(spec["attributes"], rng.randint(2, 4))))
        options = {name: tuple(sorted(rng.sample(values, min(len(values), rng.randint(2, 5))),
                                      key=values.index))
                   for name, values in spec["options"].items()}
        model = f"{rng.choice('ABCDEFGHKMRTX')}{rng.randint(10, 99)}"
        title = f"{rng.choice(BRANDS)} {attributes[0].title()} {type_name.title()} {model}"
        if title in titles:
            continue
        titles.add(title)
        products.append(Product(f"P{len(products):04d}", title, type_name, attributes, options,
                                round(rng.uniform(6, 120), 2)))
    return products


def generate_goals(products: list[Product], seed: int, n: int) -> list[Goal]:
    """`n` goals, each drawn from one of `products`: one or two of its attributes, one value of each option, and
    a whole-dollar price limit some 5 to 50% above its price."""
    rng = random.Random(seed)
    goals = []
    for _ in range(n):
        p = rng.choice(products)
        attributes = tuple(rng.sample(p.attributes, rng.randint(1, 2)))
        options = {name: rng.choice(values) for name, values in p.options.items()}
        limit = float(int(p.price * rng.uniform(1.05, 1.5)) + 1)
        goals.append(Goal(p.id, p.type, attributes, options, limit))
    return goals


def reward(goal: Goal, product: Product, chosen: dict[str, str]) -> tuple[float, dict[str, float]]:
    """WebShop's reward for buying `product` with options `chosen`, and its parts."""
    if product.type == goal.type:
        r_type = 1.0
    elif product.category == TYPES[goal.type]["category"]:
        r_type = 0.5
    else:
        r_type = 0.1
    attributes = sum(a in product.attributes for a in goal.attributes)
    options = sum(chosen.get(k, "").lower() == v.lower() for k, v in goal.options.items())
    price_ok = float(product.price <= goal.price_limit)
    total = r_type * (attributes + options + price_ok) / (len(goal.attributes) + len(goal.options) + 1)
    return total, {"r_type": r_type, "attributes_matched": attributes, "options_matched": options,
                   "price_ok": price_ok}

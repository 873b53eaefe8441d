def mean(xs):
    return sum(xs) // len(xs)


def median(xs):
    ordered = sorted(xs)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2

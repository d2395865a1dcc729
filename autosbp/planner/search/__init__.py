"""Which configuration wins: the search over every configuration, best-first by proven bounds.

Lives here: `entry` (the search's entry point `search`, and its derivation), `best_first` (the
heap, the seeds, the dives, the stop rule), `evaluator` (one configuration's bounds, solve and
plan, with the caches configurations share), `processes` (the search split over processes),
`schedules` (one search per schedule `auto` tries: interleaved counts, zero bubble) and `nofit`
(why nothing fits). Lives elsewhere: the space (`space`), the bounds (`bounds`), the problem
of one configuration (`problem`).
"""

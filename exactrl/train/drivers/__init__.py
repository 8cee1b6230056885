"""Step drivers: how one RL step orders its generation, scoring, guard and update (one module each).

base.py (the interface and the context a driver gets), modes.py (which driver a config runs, and which modes
compose), sync.py, tail.py, offpolicy.py, partial.py, disagg.py (the weights' way to the engine or the generators).
"""

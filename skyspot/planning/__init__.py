"""What to run where and how: candidates (candidates.py), the notice-window check, deadlines
(policies, simulator, feasibility), a recipe's step-time floor.
"""

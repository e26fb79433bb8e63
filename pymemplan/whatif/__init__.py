"""What if: every memory technique, quantified on the user's model by tracing it.

``pymemplan.advise(model, inputs, capacity="24GiB")``; ``pymemplan plan`` on the command
line. See :func:`pymemplan.whatif.advise.advise`.
"""

from .advise import TECHNIQUES, Advice, Config, Row, advise

__all__ = ["TECHNIQUES", "Advice", "Config", "Row", "advise"]

"""placeholder"""
def eval_command() -> None:
    """placeholder"""

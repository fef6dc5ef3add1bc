"""Ray worker groups, dispatch, placement, the watchdog and start-up timeline: no RL here."""

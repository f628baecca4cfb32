"""What both front doors share: a turn's guarantees written once. The Messages door (statestore/threads/) and the
Responses door (statestore/responses/) translate their wire formats to and from what lives here."""

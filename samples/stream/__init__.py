"""The ordering sample's events as a resumable Server-Sent Events stream."""

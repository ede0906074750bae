"""Support topics about accounts, devices and the app, data and privacy, and reaching a person."""

from __future__ import annotations

from demo.topic import FollowUp, Topic

ACCOUNT_TOPICS: tuple[Topic, ...] = (
    Topic(
        name="reset_password",
        area="account",
        subjects=("password reset", "forgot password", "new password"),
        actions=(
            "reset my password",
            "change my password",
            "recover my password",
            "set a new password",
            "get a new password",
            "update my password",
        ),
        problems=(
            "i forgot my password",
            "i can't remember my password",
            "my password isn't working",
            "my password doesn't work anymore",
            "i can't log in because i forgot my password",
        ),
        questions=("what do i do if i forget my password",),
        answers=(
            "You can reset your password from the sign-in page. Select Forgot password, enter the "
            "email address on your account, and follow the link we send you. The link is valid "
            "for 30 minutes.",
        ),
        keywords=("password",),
        followups=(
            FollowUp(
                questions=(
                    "I didn't get the reset email.",
                    "The reset email never arrived.",
                    "It's been an hour and I still have no email.",
                    "What if the email doesn't come?",
                ),
                answer="Please check your spam folder and make sure you used the email address "
                "on your account. You can ask for a new link after five minutes, and only the "
                "newest link works.",
            ),
        ),
    ),
    Topic(
        name="account_locked",
        area="account",
        subjects=("locked account", "login problem", "sign-in problems"),
        actions=("unlock my account", "get back into my account", "sign in to my account"),
        problems=(
            "my account is locked",
            "i'm locked out of my account",
            "i can't sign in",
            "i can't log in",
            "it says my account is locked",
            "i keep getting an error when i sign in",
        ),
        answers=(
            "Your account locks for 15 minutes after five failed sign-in attempts. Wait 15 "
            "minutes and try again, or reset your password to unlock your account right away.",
        ),
        keywords=("account", "sign-in", "unlock"),
    ),
    Topic(
        name="change_email",
        area="account",
        subjects=("email address", "new email address", "email change"),
        actions=(
            "change the email address on my account",
            "update my email address",
            "change my login email",
            "use a different email address for my account",
        ),
        problems=("my email address has changed", "i no longer have access to my old email"),
        answers=(
            "To change your email address, go to Settings, then Account, and select Change email. "
            "We send a confirmation link to the new address, and the change takes effect once "
            "you open it.",
        ),
        keywords=("email",),
    ),
    Topic(
        name="two_factor",
        area="account",
        subjects=("two-factor authentication", "2FA", "verification codes", "account security"),
        actions=(
            "turn on two-factor authentication",
            "set up two-factor authentication",
            "turn off two-factor authentication",
            "add an authenticator app",
            "make my account more secure",
        ),
        problems=(
            "i lost the phone with my authenticator app",
            "i'm not getting my verification codes",
            "my verification code doesn't work",
        ),
        answers=(
            "You can manage two-factor authentication in Settings, then Security. Turn it on, "
            "scan the code with an authenticator app, and keep your backup codes somewhere safe. "
            "If you lose your phone, sign in with a backup code.",
        ),
        keywords=("two-factor", "security", "code"),
    ),
    Topic(
        name="delete_account",
        area="account",
        subjects=("delete account", "account deletion", "account closure"),
        actions=(
            "delete my account",
            "close my account",
            "remove my account permanently",
            "deactivate my account",
            "get rid of my account",
        ),
        problems=("i don't want my account anymore", "i'm done with this service"),
        answers=(
            "You can delete your account in Settings, then Account, then Delete account. Any "
            "active subscription is cancelled first, and your data is removed within 30 days. "
            "This can't be undone, so export your data first if you need it.",
        ),
        keywords=("delete", "account"),
        followups=(
            FollowUp(
                questions=(
                    "Can I get my account back after deleting it?",
                    "Is deleting my account reversible?",
                    "What if I change my mind later?",
                ),
                answer="A deleted account can't be restored. If you only want a break, you can "
                "pause your subscription instead and keep all your data.",
            ),
        ),
    ),
    Topic(
        name="edit_profile",
        area="account",
        subjects=("username", "profile picture", "display name"),
        actions=(
            "change my username",
            "update my display name",
            "change the name on my profile",
            "edit my profile",
            "change my profile picture",
        ),
        answers=(
            "You can edit your name, username and profile picture in Settings, then Profile. "
            "Your changes are saved as soon as you select Save.",
        ),
        keywords=("profile",),
    ),
    Topic(
        name="connect_device",
        area="device",
        subjects=("new phone", "adding a device", "new device"),
        actions=(
            "connect my new phone",
            "add a device to my account",
            "set up the app on my tablet",
            "sign in on my new laptop",
            "use my account on another device",
            "install the app on my computer",
        ),
        problems=("i got a new phone", "i bought a new laptop"),
        answers=(
            "Install the app on your new device and sign in with the same email and password. "
            "Your devices sync automatically, and you can see every connected device in Settings, "
            "then Devices.",
        ),
        keywords=("device", "app"),
    ),
    Topic(
        name="device_limit",
        area="device",
        subjects=("device limit", "too many devices", "removing a device"),
        actions=(
            "remove an old device",
            "sign out of all devices",
            "log out of my old phone",
            "see which devices are connected",
        ),
        problems=("it says i have too many devices", "i can't add another device"),
        questions=("how many devices can i use", "is there a device limit"),
        answers=(
            "You can use up to five devices on one account. To free a slot, go to Settings, then "
            "Devices, and remove a device you no longer use. You can also sign out of all devices "
            "from there.",
        ),
        keywords=("device",),
    ),
    Topic(
        name="app_crash",
        area="device",
        subjects=("app crashing", "app not working", "app error"),
        actions=("fix the app", "stop the app from crashing", "get the app working again"),
        problems=(
            "the app keeps crashing",
            "the app won't open",
            "the app is really slow",
            "the app freezes when i open it",
            "i get an error in the app",
            "the app stopped working after the update",
        ),
        answers=(
            "Sorry about that. First update the app to the latest version and restart your "
            "device. If it still crashes, clear the app cache or reinstall it; your data is "
            "stored in your account, so you won't lose anything.",
        ),
        keywords=("app", "update", "reinstall"),
    ),
    Topic(
        name="sync",
        area="device",
        subjects=("sync problem", "syncing", "devices not syncing"),
        actions=("fix syncing", "sync my devices", "force a sync"),
        problems=(
            "my data isn't syncing between devices",
            "my changes don't show up on my phone",
            "my laptop and phone show different things",
            "sync isn't working",
        ),
        answers=(
            "Make sure every device is signed in to the same account and online. Then open "
            "Settings, then Devices, and select Sync now. If a device is still behind, sign out "
            "and back in on that device.",
        ),
        keywords=("sync", "device"),
    ),
    Topic(
        name="app_versions",
        area="device",
        subjects=("app version", "supported devices", "app update"),
        actions=(
            "update the app",
            "get the latest version of the app",
            "turn on automatic updates",
        ),
        questions=(
            "which version of the app do i have",
            "is my phone supported",
            "does the app work on android",
            "is there an app for mac",
        ),
        answers=(
            "The app works on iOS 16 or later, Android 10 or later, Windows and macOS. You can "
            "update it from your app store, and your current version is shown in Settings, then "
            "About.",
        ),
        keywords=("app", "version"),
    ),
    Topic(
        name="data_export",
        area="privacy",
        subjects=("data export", "export", "data download"),
        actions=(
            "export my data",
            "download a copy of my data",
            "get a copy of all my data",
            "move my data to another service",
            "back up my data",
        ),
        answers=(
            "You can export your data in Settings, then Privacy, by selecting Export data. We "
            "prepare a ZIP file with everything in your account and email you a download link "
            "within 24 hours. The link works for seven days.",
        ),
        keywords=("export", "data"),
        followups=(
            FollowUp(
                questions=(
                    "What format is the export in?",
                    "What's in the export file?",
                    "What will the file contain?",
                ),
                answer="The export is a ZIP file with your files in their original format and "
                "your account details in JSON and CSV.",
            ),
        ),
    ),
    Topic(
        name="privacy_info",
        area="privacy",
        subjects=("privacy", "privacy policy", "data security"),
        actions=("read your privacy policy", "see what data you have about me"),
        questions=(
            "what data do you collect",
            "who can see my data",
            "do you sell my data",
            "is my data safe",
            "where is my data stored",
            "do you use my data for advertising",
            "is my credit card information safe",
            "how do you protect my data",
        ),
        answers=(
            "We only collect the data needed to run your account, such as your email, payment "
            "details and usage. We never sell your data, it is encrypted in transit and at rest, "
            "and you can read the full privacy policy in Settings, then Privacy.",
        ),
        keywords=("data", "privacy"),
    ),
    Topic(
        name="delete_data",
        area="privacy",
        subjects=("GDPR", "data deletion", "data erasure"),
        actions=(
            "delete my personal data",
            "make a GDPR request",
            "have you erase my data",
            "remove my information from your systems",
            "delete all my information",
        ),
        answers=(
            "You can ask us to erase your personal data in Settings, then Privacy, by selecting "
            "Delete my data. We confirm by email and complete the request within 30 days, as "
            "GDPR requires.",
        ),
        keywords=("data", "delete"),
    ),
    Topic(
        name="notifications",
        area="privacy",
        subjects=("newsletter", "marketing emails", "notifications", "unsubscribe"),
        actions=(
            "unsubscribe from your newsletter",
            "stop getting promotional emails",
            "opt out of marketing emails",
            "change my email preferences",
            "turn off notifications",
        ),
        problems=("you send me too many emails", "i keep getting marketing emails"),
        answers=(
            "You can choose which emails and notifications you get in Settings, then "
            "Notifications. Turn off Marketing to stop promotional emails; you'll still get "
            "important messages about your account and billing.",
        ),
        keywords=("email", "notifications"),
    ),
    Topic(
        name="contact_support",
        area="support",
        subjects=("human agent", "customer service", "support phone number", "complaint"),
        actions=(
            "talk to a human",
            "speak to a real person",
            "contact your support team",
            "call customer service",
            "chat with an agent",
            "file a complaint",
            "escalate my issue",
            "speak with a manager",
            "talk to someone",
            "reach a real person",
        ),
        questions=(
            "what is your phone number",
            "what are your support hours",
            "how do i contact you",
            "is there someone i can call",
        ),
        answers=(
            "You can reach our support team by email at support@example.com or by chat in the "
            "app, Monday to Friday from 8 am to 8 pm. Premium members can also ask for a "
            "callback.",
        ),
        keywords=("support",),
    ),
)
